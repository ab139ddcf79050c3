"""Sparse attention run per sequence (family ``indexers``): packed == each sequence alone.

DSA lightning indexers (DeepSeek-V3.2, GLM-MoE-DSA with its reused selections, HY-V4, AXK2, dots3), DeepSeek-V4's
compressors and indexer, Qwen4-Exp's QSA indexer, n-gram embeddings and GatedDeltaNet are proven
with :func:`padfree.proof.compare.prove` — logits, loss and every gradient in fp32 under each attention implementation
the model has, bf16 autocast and bf16 weights — next to negative controls the same comparison catches, the selection
itself checked against each sequence's own (sequences shorter than ``k`` included), groups of equal lengths, the
selection merged across layers, the cut masks, and the refusals.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model.configure import install_packing, packing_state, unconfigure_packing  # noqa: E402
from padfree.model.families import indexers, replay  # noqa: E402
from padfree.model.flight import forward_of  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.model.state import PackingState  # noqa: E402
from padfree.proof.compare import FP32_TOL, prove, stock_packed_diff  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import packed_case  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# model type, config fields on top of the sweep's tiny defaults, attention implementations the class has
GLM_SHARED = dict(num_hidden_layers=3, layer_types=["indexed_attention"] * 3,
                  indexer_types=["full", "shared", "shared"], mlp_layer_types=["dense", "sparse", "sparse"])
V4_SLIDING = dict(num_hidden_layers=3, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                    "heavily_compressed_attention"])
QWEN4_PLE = dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "indexed_attention"],
                 ple_layer_ids=[1, 2], eos_token_id=2)
CASES = {
    "deepseek_v32": ("deepseek_v32", {}, ("sdpa", "eager")),
    "glm_moe_dsa": ("glm_moe_dsa", {}, ("sdpa", "eager")),
    "glm_moe_dsa-shared": ("glm_moe_dsa", GLM_SHARED, ("sdpa",)),
    "hy_v4": ("hy_v4", {}, ("eager",)),  # sinks: transformers has eager only
    "axk2": ("axk2", {}, ("sdpa", "eager")),
    "dots3_note_text": ("dots3_note_text", {}, ("sdpa", "eager")),
    "deepseek_v4": ("deepseek_v4", {}, ("eager",)),
    "deepseek_v4-sliding": ("deepseek_v4", V4_SLIDING, ("eager",)),
    "qwen4_exp_text": ("qwen4_exp_text", {}, ("sdpa", "eager")),
    "qwen4_exp_text-ple": ("qwen4_exp_text", QWEN4_PLE, ("sdpa",)),
}


def tiny(case: str, attn: str | None = None) -> transformers.PreTrainedModel:
    model_type, variant, attns = CASES[case]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = build_tiny(model_type, variant)
    model.set_attn_implementation(attn or attns[0])
    return model


PROOFS = [(case, attn) for case, (_, _, attns) in CASES.items() for attn in attns]


@pytest.mark.parametrize(("case", "attn"), PROOFS, ids=[f"{c}-{a}" for c, a in PROOFS])
def test_packed_equals_each_sequence_alone(case, attn):
    model = tiny(case, attn)
    first = attn == CASES[case][2][0]
    proof = prove(model, backends=["sdpa"], precisions=("fp32", "autocast_bf16", "bf16") if first else ("fp32",))
    assert proof.ok, f"\n{proof}"
    assert {c.backend for c in proof.checks} == {"none"}  # every attention layer runs per sequence
    assert all(c.sees_leaks for c in proof.checks if c.precision == "fp32")
    assert model.config._attn_implementation == attn  # transformers' own implementation, untouched
    claimed = [name for name, m in model.named_modules() if type(m).__name__ in indexers.CLASSES]
    assert claimed and set(claimed) <= set(proof.mixers)


@pytest.mark.parametrize("case", [c for c in CASES if "-" not in c])
def test_the_same_comparison_catches_stock_transformers_leaking(case):
    """Keys of other sequences in the top-k, windows compressed across boundaries, one causal mask over the row."""
    assert stock_packed_diff(tiny(case)) > FP32_TOL


def test_the_same_comparison_catches_a_topk_over_padded_groups(monkeypatch):
    """The negative control of the grouping: a selecting module run on buckets padded past a sequence's end ranks
    its keys in a longer row, and ties (ReLU scores of exactly 0) break otherwise than alone."""
    monkeypatch.setitem(indexers.SPECS, "DeepseekV32Attention",
                        indexers.Spec("padded buckets", selects=lambda module: False))
    proof = prove(tiny("deepseek_v32"), backends=["sdpa"], precisions=["fp32"])
    assert not proof.ok and proof.checks[0].logits > 100 * FP32_TOL


def _strip(model: torch.nn.Module, suffix: str) -> None:
    for name, sub in model.named_modules():
        if name.endswith(suffix) and "_padfree_indexed" in sub.__dict__:
            del sub._padfree_indexed
            del sub.__dict__["forward"]


def test_the_same_comparison_catches_ngram_embeddings_over_the_row():
    """Qwen4-Exp's per-layer n-gram embeddings and their dilated convolution, left to run over the whole row: the
    first tokens of a sequence hash the tokens before it (alone they hash end-of-sequence padding)."""
    def configure(model, backend):
        report = install_packing(model, backend=backend)
        _strip(model, ".ple")
        return report

    proof = prove(tiny("qwen4_exp_text-ple"), backends=["sdpa"], precisions=["fp32"], configure=configure)
    assert not proof.ok and proof.checks[0].logits > 100 * FP32_TOL


# ---- the rows: sequences shorter than k = 4, groups of equal lengths, a trailing filler run ------------------------




def _rows(vocab: int, lengths: list[list[int]], seed: int = 0):
    return packed_case(vocab, lengths, seed, filler=4)  # the filler run: a segment of its own, never compared


def _vocab(model) -> int:
    return model.config.get_text_config().vocab_size


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa-shared", "hy_v4", "dots3_note_text",
                                  "deepseek_v4-sliding", "qwen4_exp_text-ple"])
def test_groups_of_equal_lengths_are_exact(case):
    """Several sequences of one length run as one group: each keeps the selection it makes alone."""
    model = tiny(case)
    ids, pos, segments = _rows(_vocab(model), [[20, 1, 20, 7, 3], [7, 20, 20, 1, 7]])
    with torch.no_grad():
        alone = [model(input_ids=ids[b:b + 1, s:s + n], use_cache=False).logits[0] for b, s, n in segments]
        install_packing(model)
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        unconfigure_packing(model)
    for (b, s, n), want in zip(segments, alone, strict=True):
        assert float((packed[b, s:s + n] - want).abs().max()) <= FP32_TOL * max(1.0, float(want.abs().max()))


def test_a_segment_id_mask_with_trailing_padding():
    """Boundaries given as a LLaMA-Factory segment mask (``[1, 1, 1, 2, 3, 3, ..., 0, 0]``) instead of positions."""
    model = tiny("glm_moe_dsa-shared")
    seqs = [torch.randint(3, _vocab(model), (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 1, 12)]
    ids = torch.cat([*seqs, torch.zeros(3, dtype=torch.long)])[None]
    segments = torch.tensor([[1] * 3 + [2] + [3] * 12 + [0] * 3])
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        install_packing(model)
        packed = model(input_ids=ids, attention_mask=segments, use_cache=False).logits[0]
        unconfigure_packing(model)
    start = 0
    for s, want in zip(seqs, alone, strict=True):
        assert float((packed[start:start + len(s)] - want).abs().max()) <= FP32_TOL * max(1.0, float(want.abs().max()))
        start += len(s)


def _record(model: torch.nn.Module, suffix: str, out: dict) -> list:
    """Forward hooks storing every output of the modules named ``*suffix`` by (name, tokens per row)."""
    def hook(name):
        def store(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            out[name, hidden.shape[1]] = output
        return store

    return [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in model.named_modules() if n.endswith(suffix)]


# every length distinct (the filler runs too), so each indexer call of the packed forward is one sequence's
DISTINCT = [[1, 3, 9, 40], [2, 6, 30]]  # fillers of 4 and 19


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "dots3_note_text", "deepseek_v4",
                                  "qwen4_exp_text"])
def test_every_sequence_selects_what_it_selects_alone(case):
    """The indexers' own output — top-k key indices (DSA; DeepSeek-V4 over compressed windows, -1 where a query has
    fewer ready windows than k) or QSA's token mask — equals each sequence's alone, including sequences shorter
    than k (all their keys)."""
    model = tiny(case)
    ids, pos, segments = _rows(_vocab(model), DISTINCT)
    alone, packed = {}, {}
    with torch.no_grad():
        handles = _record(model, "indexer", alone)
        for b, s, n in segments:
            model(input_ids=ids[b:b + 1, s:s + n], use_cache=False)
        for h in handles:
            h.remove()
        install_packing(model)
        handles = _record(model, "indexer", packed)
        model(input_ids=ids, position_ids=pos, use_cache=False)
        for h in handles:
            h.remove()
        unconfigure_packing(model)
    assert alone and alone.keys() <= packed.keys()
    for key, want in alone.items():
        assert torch.equal(packed[key], want), key
    if case != "qwen4_exp_text":  # a sequence shorter than k keeps every one of its keys
        short = [want for (_, n), want in alone.items() if n == 3]
        assert short and all(w.shape[-1] <= 3 for w in short)


def test_the_selection_handed_to_reusing_layers_is_each_sequences_own():
    """GLM-MoE-DSA hands layer 0's selection on: merged over the row it holds each sequence's own indices, padded by
    repeating its first pick (which selects nothing new)."""
    model = tiny("glm_moe_dsa-shared")
    ids, pos, segments = _rows(_vocab(model), DISTINCT)
    alone, packed = {}, {}
    with torch.no_grad():
        handles = _record(model, "layers.0.self_attn", alone)
        for b, s, n in segments:
            model(input_ids=ids[b:b + 1, s:s + n], use_cache=False)
        for h in handles:
            h.remove()
        install_packing(model)
        handles = _record(model, "layers.0.self_attn", packed)
        model(input_ids=ids, position_ids=pos, use_cache=False)
        for h in handles:
            h.remove()
        unconfigure_packing(model)
    (merged,) = [out[2] for out in packed.values()]
    assert merged.shape[:2] == ids.shape and merged.dtype == torch.int32
    for b, s, n in segments:
        want = alone["model.layers.0.self_attn", n][2][0]
        k = want.shape[-1]
        assert torch.equal(merged[b, s:s + n, :k], want)
        assert torch.equal(merged[b, s:s + n, k:], merged[b, s:s + n, :1].expand(n, merged.shape[-1] - k))


# ---- the pieces: merging selections, cutting the row's mask ---------------------------------------------------------


def _layout(rows: list[list[int]]) -> tuple[PackedLayout, list[tuple[int, int, int]]]:
    width = max(sum(r) for r in rows) + 2
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    segments = []
    for b, row in enumerate(rows):
        col = 0
        for n in row:
            pos[b, col:col + n] = torch.arange(n)
            segments.append((b, col, n))
            col += n
        pos[b, col:] = torch.arange(width - col)  # the trailing padding run
        segments.append((b, col, width - col))
    return PackedLayout.from_position_ids(pos), segments


@pytest.mark.parametrize("by", ["length", "bucket"])
def test_merge_selection_puts_every_sequences_picks_in_its_rows(by):
    lay, segments = _layout([[1, 3, 9, 9, 1], [2, 12, 9]])
    k = 4
    g = torch.Generator().manual_seed(0)
    width = {}  # a group's selection has one width (min(k, its length))
    own = {}  # start token -> (n, selection (n, width))
    plan = lay.buckets(by)
    starts = plan.slots.split(plan.sizes)
    groups = []
    for length, count, slots in zip(plan.lengths, plan.counts, starts, strict=True):
        w = width.setdefault(length, min(k, length))
        rows = []
        for first in slots.view(count, length)[:, 0].tolist():
            b, s = divmod(first, lay.shape[1])
            n = next(n for bb, ss, n in segments if (bb, ss) == (b, s))
            sel = torch.randint(0, n, (length, w), generator=g, dtype=torch.int32)  # rows past n: padded slots
            own[b, s] = (n, sel[:n])
            rows.append(sel)
        groups.append(torch.stack(rows))
    merged = indexers.merge_selection(groups, lay, by)
    assert merged.shape == (*lay.shape, k) and merged.dtype == torch.int32
    for (b, s), (n, sel) in own.items():
        w = sel.shape[-1]
        assert torch.equal(merged[b, s:s + n, :w], sel)
        assert torch.equal(merged[b, s:s + n, w:], sel[:, :1].expand(n, k - w))


@pytest.mark.parametrize(("case", "attn", "mask"), [("deepseek_v32", "sdpa", "causal"),
                                                    ("deepseek_v32", "eager", "causal"),
                                                    ("deepseek_v4", "eager", "sliding")])
def test_the_cut_row_mask_is_the_mask_a_sequence_builds_alone(case, attn, mask):
    from transformers import masking_utils

    build = {"causal": masking_utils.create_causal_mask,
             "sliding": masking_utils.create_sliding_window_causal_mask}[mask]
    config = tiny(case, attn).config
    hidden = config.get_text_config().hidden_size

    def row_mask(n):
        return build(config, torch.zeros(1, n, hidden), None, None, position_ids=torch.arange(n)[None],
                     allow_is_causal_skip=False)

    width = 20
    lay = PackedLayout.from_position_ids(torch.arange(width).repeat(2, 1))
    cut = replay.cut_mask(row_mask(width), lay, "test")  # the mask cutter the indexers use
    for n in (1, 3, 7, width):
        assert torch.equal(cut(n, 3), row_mask(n).expand(3, -1, -1, -1))


# ---- refusals and what stays transformers' own -----------------------------------------------------------------------


def test_a_cache_is_refused_by_the_model_and_by_the_module():
    model = tiny("deepseek_v32")
    install_packing(model)
    ids = torch.randint(3, _vocab(model), (1, 6))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(PackingDisabledError, match="cache"):
        model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
    # the module's own guard: a packed layout in flight and a cache handed to the attention directly
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(1, 6, model.config.hidden_size)
    tables = model.model.rotary_emb(hidden, torch.arange(6)[None])
    with forward_of(packing_state(model), PackedLayout.from_position_ids(pos)), \
            pytest.raises(PackingDisabledError, match="cache=DynamicCache"):
        attn(hidden, position_embeddings=tables, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool),
             cache=cache)
    unconfigure_packing(model)


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa-shared", "qwen4_exp_text"])
def test_cached_generation_and_padded_batches_run_transformers_own_code(case):
    model = tiny(case)
    vocab = _vocab(model)
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        logits = model(input_ids=ids, attention_mask=mask).logits
        install_packing(model)
        model.config.use_cache = True  # generation with a cache, on the configured model
        got = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert torch.equal(got, want)
        assert torch.equal(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, logits)
    unconfigure_packing(model)


def test_a_model_that_also_has_backend_attention_is_refused():
    """The groups are cut from the row's own tables (positions 0 .. T-1, the row's causal mask): next to attention
    on padfree's backends, which hands restarting positions and no mask down, they would be wrong."""
    model = tiny("deepseek_v32")
    with pytest.raises(UnsupportedModelError, match="DeepseekV32Attention runs per sequence"):
        indexers.install(model.model.layers[0].self_attn, PackingState("padfree_sdpa", report=None))


def test_activation_checkpointing_recomputes_the_same_groups():
    model = tiny("glm_moe_dsa-shared")
    ids, pos, segments = _rows(_vocab(model), DISTINCT)

    def grads(packed: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if packed:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            parts = [logits[b, s:s + n] for b, s, n in segments]
        else:
            parts = [model(input_ids=ids[b:b + 1, s:s + n], use_cache=False).logits[0] for b, s, n in segments]
        loss = sum(torch.nn.functional.cross_entropy(x[:-1], ids[b, s + 1:s + n], reduction="sum")
                   for x, (b, s, n) in zip(parts, segments, strict=True) if n > 1)
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    want = grads(False)
    install_packing(model)
    got = grads(True)
    unconfigure_packing(model)
    assert want.keys() == got.keys()
    for k in want:
        assert float((got[k] - want[k]).abs().max()) <= FP32_TOL * max(1.0, float(want[k].abs().max())), k
