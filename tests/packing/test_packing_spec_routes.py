"""``PackingSpec`` through the routes that the other test files do not cover: the trainers' packing and the
distributed batch sampler (each gives what its keywords give, refuses a setting given both ways, and refuses a
strategy that cuts samples where sample indices cannot name a piece)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from padfree import (  # noqa: E402
    DistributedPackedBatchSampler,
    InvalidArgumentError,
    PackingSpec,
    pack_for_trainer,
    plan_dataset,
)
from padfree.integrations.trainer_data import trainer_rows  # noqa: E402
from realdata import gsm8k_records  # noqa: E402

datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tokenized():
    from padfree.corpus import load_tokenizer

    tok = load_tokenizer()
    records = gsm8k_records(120)
    ids = tok([r["instruction"] + " " + r["output"] for r in records], add_special_tokens=False)["input_ids"]
    return datasets.Dataset.from_dict({"input_ids": ids})


@pytest.mark.parametrize("strategy", ["obfd", "wrapped"])
def test_pack_for_trainer_takes_a_spec_and_its_plan_has_its_own_route(tokenized, strategy):
    overlong = "split" if strategy == "wrapped" else "error"
    by_spec = pack_for_trainer(tokenized, spec=PackingSpec(384, strategy, overlong=overlong))
    by_keywords = pack_for_trainer(tokenized, 384, strategy, overlong=overlong)
    assert by_spec[:] == by_keywords[:] and len(by_spec) > 1
    assert by_spec.column_names == ["input_ids", "labels", "position_ids", "seq_lens"]
    plan = plan_dataset(tokenized, 384, strategy, overlong=overlong)
    assert trainer_rows(plan, tokenized)[:] == by_spec[:] and plan.num_bins == len(by_spec)
    with pytest.raises(InvalidArgumentError, match=r"max_length=384 is given both as a keyword and in spec"):
        pack_for_trainer(tokenized, 384, spec=PackingSpec(384))


def test_the_sampler_takes_a_spec_and_refuses_what_sample_indices_cannot_follow(tokenized):
    lengths = [len(ids) for ids in tokenized["input_ids"]]

    def batches(**kwargs):
        return [list(DistributedPackedBatchSampler(lengths, num_replicas=2, rank=r, micro_batch_size=2, **kwargs))
                for r in range(2)]

    assert batches(spec=PackingSpec(512, "ffd", max_sequences_per_bin=4)) == \
        batches(capacity=512, strategy="ffd", max_sequences_per_bin=4)
    with pytest.raises(InvalidArgumentError, match=r"capacity=512 is given both as a keyword and in spec"):
        batches(capacity=512, spec=PackingSpec(512))
    with pytest.raises(InvalidArgumentError, match=r"spec\.seed=3 does not apply"):
        batches(spec=PackingSpec(512, "ffs", seed=3))
    for kwargs in ({"capacity": 512, "strategy": "wrapped"}, {"spec": PackingSpec(512, "wrapped")}):
        with pytest.raises(InvalidArgumentError, match=r"strategy='wrapped' cuts samples at the rows' edges"):
            batches(**kwargs)
