"""The model entry points on wrapped models: ``configure_packing``, ``unconfigure_packing``,
``check_packing_support``, ``verify`` and ``packing_status`` take a PeftModel (LoRA, DoRA, ``modules_to_save``),
``torch.compile``, DDP and FSDP2 wrappers, nested, and act on the transformers model inside; anything with no model
inside is one clear error; a prompt-learning adapter, and an adapter on a convolution over the sequence, are refused
by name.

Every exactness check is one packed forward + backward through the wrapper against every sequence alone (fp32,
1e-5), with its control: the same rows with positions running on across sequences (no boundary) are far off.
Compiled wrappers run under ``torch.compiler.set_stance("force_eager")``: what is checked here is that the entry
points find the model inside; compiled packed steps themselves are proven in ``test_model_compile``.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import padfree  # noqa: E402
from multiproc import free_port, run_ranks  # noqa: E402
from padfree import configure_packing, unconfigure_packing, verify  # noqa: E402
from padfree.errors import UnsupportedModelError, describe  # noqa: E402
from padfree.model.configure import check_packing_support, packing_state, refresh_packing  # noqa: E402
from padfree.model.wrappers import transformers_model, unwrap_model, wrapper_chain  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import max_diff, packed_rows, run_packed, run_separately, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
ROWS = [[9, 6, 3], [7, 5, 4]]  # two packed rows of three sequences (the second ends in a filler run)
DATA = [[5, 6, 7, 8, 9, 10, 11], [9, 10, 11, 12], [12, 13, 14, 15, 16, 17]]  # for verify
MIXER = {"llama": "self_attn", "qwen3_5_text": "linear_attn"}  # a token mixer to copy with modules_to_save


def _lora(model, **kw):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False,
                                                      **kw))


def _modules_to_save(model):
    mixer = MIXER[model.config.model_type]
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["gate_proj"], modules_to_save=["lm_head", "embed_tokens", mixer],
        init_lora_weights=False))


WRAPPERS = {
    "lora": _lora,
    "dora": lambda m: _lora(m, use_dora=True),
    "modules_to_save": _modules_to_save,
    "compile": torch.compile,
    "compile(lora)": lambda m: torch.compile(_lora(m)),
}


def _exact_through(wrapped) -> tuple[float, float, float, int]:
    """``(max |Δlogit|, max |Δgrad|, max |Δlogit| of the leaking control, trainable gradients)``: the packed rows
    through ``wrapped`` vs every sequence alone, and the same rows with positions running on (one long sequence)."""
    ids, pos, seqs = packed_rows(ROWS)
    with torch.compiler.set_stance("force_eager"):
        packed, g_packed = run_packed(wrapped, ids, pos, seqs)
        alone, g_alone = run_separately(wrapped, seqs)
        running = torch.arange(ids.shape[1]).expand_as(ids)
        leak, _ = run_packed(wrapped, ids, running, seqs, grad=False)
    names = {n.removeprefix("_orig_mod.") for n in g_alone}
    assert names == set(g_packed), "both runs reach the same parameters"
    grad = max(float((g_packed[n.removeprefix("_orig_mod.")] - g).abs().max()) for n, g in g_alone.items())
    return max_diff(packed, alone), grad, max_diff(leak, alone), len(g_packed)


@pytest.mark.parametrize("kind", WRAPPERS)
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_a_wrapped_model_is_checked_configured_verified_and_undone(model_type, kind, tmp_path):
    model = tiny_model(model_type)
    wrapped = WRAPPERS[kind](model)
    assert unwrap_model(wrapped) is model and transformers_model(wrapped) is model
    assert check_packing_support(wrapped).ok

    report = configure_packing(wrapped)
    assert report.supported and packing_state(model) is not None and report.attention_modules
    assert model.config._attn_implementation == report.backend == "padfree_sdpa" and not model.config.use_cache
    assert check_packing_support(wrapped).ok  # asked again: the configured model's own report
    if model_type == "qwen3_5_text":
        assert report.mixers  # the GatedDeltaNet layers (and modules_to_save's copies of them) reset per sequence

    logits, grads, leak, trainable = _exact_through(wrapped)
    assert logits <= TOL and grads <= TOL, (logits, grads)
    assert leak > 1e-3, leak  # the same comparison sees a row whose positions do not restart
    if kind != "compile":  # a PEFT model trains its adapters (and modules_to_save's copies) only
        assert 0 < trainable < len(list(model.parameters()))
    with torch.compiler.set_stance("force_eager"):
        checked = verify(wrapped, DATA)
    assert checked.ok and checked.backend == "padfree_sdpa" and checked.max_grad_diff is not None, str(checked)

    trainer = transformers.Trainer(model=wrapped, args=transformers.TrainingArguments(
        str(tmp_path), report_to="none", use_cpu=True))
    status = padfree.packing_status(trainer)
    assert status.model_type == model_type and status.attention == "padfree_sdpa"
    assert bool(status.mixers) == (model_type == "qwen3_5_text")

    assert unconfigure_packing(wrapped) and not unconfigure_packing(wrapped)
    assert packing_state(model) is None and model.config._attn_implementation == "sdpa" and model.config.use_cache
    for module in model.modules():  # modules_to_save's copies hold their own config: given back too
        config = getattr(module, "config", None)
        assert config is None or config._attn_implementation == "sdpa"
    assert padfree.packing_status(trainer).attention == "sdpa"


def test_the_chain_of_wrappers_is_peeled_outermost_first():
    model = tiny_model("llama")
    lora = _lora(model)
    compiled = torch.compile(lora)
    assert [type(m).__name__ for m in wrapper_chain(compiled)] == [
        "OptimizedModule", "PeftModel", "LlamaForCausalLM"]
    assert wrapper_chain(model) == [model]


def test_a_model_wrapped_after_configure_is_configured_again_by_refresh():
    """Trainers configure the model, then TRL wraps it (``peft_config=``): ``modules_to_save`` deep-copies the
    GatedDeltaNet layers with a copy of padfree's per-instance state. refresh_packing configures such a model again
    (with the arguments configure_packing had); an unchanged one keeps its report."""
    model = tiny_model("qwen3_5_text")
    report = configure_packing(model, backend="eager")
    assert refresh_packing(model) is report  # nothing changed: nothing redone
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj"], init_lora_weights=False,
                                                         modules_to_save=["linear_attn"]))
    copies = [n for n, _ in model.named_modules() if n.endswith("linear_attn.modules_to_save.default")]
    assert copies and not set(copies) & set(report.mixers)  # configured before the copies existed
    again = refresh_packing(wrapped)
    assert again is not report and again.backend == "padfree_eager" and set(copies) <= set(again.mixers)
    assert refresh_packing(wrapped) is again
    checked = verify(wrapped, DATA)
    assert checked.ok, str(checked)
    assert unconfigure_packing(wrapped) and refresh_packing(wrapped) is None

    # attention copied from a config padfree had switched already: still switched back with the model
    llama = tiny_model("llama")
    configure_packing(llama)
    wrapped = peft.get_peft_model(llama, peft.LoraConfig(r=4, target_modules=["gate_proj"], init_lora_weights=False,
                                                         modules_to_save=["self_attn"]))
    assert refresh_packing(wrapped).supported and verify(wrapped, DATA).ok
    assert unconfigure_packing(wrapped)
    assert {m.config._attn_implementation for m in llama.modules() if hasattr(m, "config")} == {"sdpa"}

    gemma = build_tiny("recurrent_gemma")
    configure_packing(gemma)
    name = next(n for n, m in gemma.named_modules() if isinstance(m, torch.nn.Conv1d))
    peft.get_peft_model(gemma, peft.LoraConfig(r=gemma.get_submodule(name).groups, target_modules=[name]))
    with pytest.raises(UnsupportedModelError, match=f"{name}: a PEFT adapter"):
        refresh_packing(gemma)  # an adapter that mixes tokens, added after configure: refused when asked again


# ---- DDP and FSDP2 (one gloo process) -------------------------------------------------------------------------------


def _distributed_worker(rank: int, world: int, tmp: str, port: int) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    model = tiny_model("qwen3_5_text")
    ddp = DistributedDataParallel(torch.compile(_lora(model)))  # three wrappers deep
    out["ddp chain"] = [type(m).__name__ for m in wrapper_chain(ddp)]
    out["ddp check"] = check_packing_support(ddp).ok
    out["ddp configured"] = configure_packing(ddp).supported and packing_state(model) is not None
    with torch.compiler.set_stance("force_eager"):
        out["ddp verify"] = verify(ddp, DATA).ok
    out["ddp undone"] = (unconfigure_packing(ddp), unconfigure_packing(ddp), model.config._attn_implementation)

    sharded = _lora(tiny_model("qwen3_5_text"))
    for layer in sharded.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(sharded)  # FSDP2 wraps nothing: the PeftModel itself becomes an FSDP module
    inner = unwrap_model(sharded)
    out["fsdp inner"] = type(inner).__name__
    out["fsdp configured"] = configure_packing(sharded).supported and packing_state(inner) is not None
    out["fsdp verify"] = verify(sharded, DATA).ok
    out["fsdp undone"] = (unconfigure_packing(sharded), unconfigure_packing(sharded))
    (Path(tmp) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def test_ddp_and_fsdp2_wrappers_are_configured_verified_and_undone(tmp_path):
    (out,) = run_ranks(_distributed_worker, tmp_path, free_port(), world=1)
    assert out["ddp chain"] == ["DistributedDataParallel", "OptimizedModule", "PeftModel",
                                "Qwen3_5ForCausalLM"]
    assert out["ddp check"] and out["ddp configured"] and out["ddp verify"]
    assert out["ddp undone"] == (True, False, "sdpa")
    assert out["fsdp inner"] == "Qwen3_5ForCausalLM"  # the layers inside are sharded; the model keeps its class
    assert out["fsdp configured"] and out["fsdp verify"] and out["fsdp undone"] == (True, False)


# ---- refusals -------------------------------------------------------------------------------------------------------

ENTRY_POINTS = {
    "configure_packing": configure_packing,
    "unconfigure_packing": unconfigure_packing,
    "check_packing_support": check_packing_support,
    "verify": lambda m: verify(m, DATA),
}


@pytest.mark.parametrize("value", ["notamodel", None, torch.nn.Linear(2, 2)], ids=["str", "None", "Linear"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_what_is_not_a_model_is_one_clear_error(entry, value):
    with pytest.raises(UnsupportedModelError) as err:
        ENTRY_POINTS[entry](value)
    message = str(err.value)
    assert message.startswith("model must be a transformers PreTrainedModel"), message  # the argument
    assert describe(value, 40) in message  # the value
    assert "PeftModel" in message and "torch.compile" in message  # what is accepted


def test_a_wrapper_around_no_model_names_both():
    with pytest.raises(UnsupportedModelError,
                       match=r"got OptimizedModule\( \(_orig_mod\): .*, which wraps Linear\(in_features=2"):
        configure_packing(torch.compile(torch.nn.Linear(2, 2)))


PROMPT_LEARNING = {
    "PREFIX_TUNING": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "PROMPT_TUNING": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "P_TUNING": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3,
                                                 encoder_hidden_size=16),
}


@pytest.mark.parametrize("kind", PROMPT_LEARNING)
def test_a_prompt_learning_adapter_is_refused_by_name(kind):
    """Its virtual tokens (or prefix cache) go before every sequence of a batch; a packed row would give them to
    its first sequence only. Refused at configure whatever ``strict`` says, by check_packing_support and by verify,
    through another wrapper too."""
    model = tiny_model("llama")
    wrapped = peft.get_peft_model(model, PROMPT_LEARNING[kind]())
    for candidate in (wrapped, torch.compile(wrapped)):
        for strict in (True, False):
            with pytest.raises(UnsupportedModelError, match=f"prompt-learning PEFT adapter \\({kind} adapter"):
                configure_packing(candidate, strict=strict)
        verdict = check_packing_support(candidate)
        assert not verdict.ok and kind in verdict.reason
        with pytest.raises(UnsupportedModelError, match=f"{kind} adapter"):
            verify(candidate, DATA)
    assert packing_state(model) is None and model.config._attn_implementation == "sdpa"
    # what is refused: the adapter makes the sequence longer than its tokens (virtual tokens come first)
    if kind != "PREFIX_TUNING":
        out = wrapped(input_ids=torch.tensor([DATA[0]]), use_cache=False)
        assert out.logits.shape[1] == len(DATA[0]) + 3


def test_an_adapter_on_a_convolution_over_the_sequence_is_refused_by_name():
    """RecurrentGemma's recurrent block: padfree runs its depthwise conv_1d restarted at every sequence; LoRA on
    it adds a second convolution over the row that nothing restarts. Refused by name; configured anyway
    (``strict=False``), the packed row reads the previous sequence — what the refusal prevents."""
    model = build_tiny("recurrent_gemma")
    name = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv1d))
    groups = model.get_submodule(name).groups
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=groups, target_modules=[name], init_lora_weights=False))
    verdict = check_packing_support(wrapped)
    assert not verdict.ok and verdict.module == name and "convolution over the sequence" in verdict.reason
    with pytest.raises(UnsupportedModelError, match=f"{name}: a PEFT adapter \\(peft.tuners.lora.layer.Conv1d\\)"):
        configure_packing(wrapped)
    assert packing_state(model) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = configure_packing(wrapped, strict=False)
    assert not report.supported and name in report.unsupported
    leaking = verify(wrapped, DATA)
    assert not leaking.ok and leaking.max_logit_diff > 1e-3, str(leaking)
    assert unconfigure_packing(wrapped)


def test_install_packing_takes_the_model_itself():
    from padfree.model.install import install_packing

    with pytest.raises(UnsupportedModelError, match="install_packing takes the transformers model itself"):
        install_packing(torch.compile(tiny_model("llama")))
