"""flex_attention: refused on the CPU by configure_packing, by name; proven packed vs separate on CUDA.

On the CPU torch has no flex_attention backward, and its compiled CPU kernel (inductor's C++ template) computes
wrong attention for some shapes: with 8-wide float vectors (AVX2) and head_dim 8 or 16, a key block of 8 mod 16
tokens (rows of 8, 24, ... 120 tokens) goes through a 16-column micro-kernel that reads keys past the block and
writes past the scores into the softmax maxima — off by 0.1-2 or NaN, differently each run, in padfree's packed rows
and in the unpacked forwards transformers runs under flex alike. padfree's BlockMask is not the cause: under torch's
uncompiled flex it gives the dense masked attention exactly (``tests/model/test_model_packed.py`` checks it pair by
pair).
"""

from __future__ import annotations

import pytest
import torch

import padfree
from padfree import configure_packing
from padfree.errors import UnsupportedModelError
from padfree.model.configure import check_packing_support, packing_state
from padfree.model.install import install_packing
from zoo import CAPACITY, LENGTHS, sequences, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5


@pytest.mark.parametrize("backend", ["flex_attention", "padfree_flex"])
def test_flex_on_the_cpu_is_refused_by_name_at_configure(backend):
    model = tiny_model("llama")
    with pytest.raises(UnsupportedModelError, match=rf"backend='{backend}' is refused on the CPU: .*flex_attention "
                                                    r"backward.* wrong attention.*use backend='sdpa' or 'auto'"):
        configure_packing(model, backend=backend)
    assert packing_state(model) is None and model.config._attn_implementation == "sdpa"  # nothing left behind
    with pytest.raises(UnsupportedModelError, match="refused on the CPU"):
        install_packing(model, backend=backend)  # the machinery the sweep and certification use refuses it too
    assert not check_packing_support(model, backend=backend).ok
    # control: the refusal is flex's on this device, not the model's — the same model configures on the others
    assert configure_packing(model, backend="sdpa").backend == "padfree_sdpa"
    assert configure_packing(model).backend == "padfree_sdpa"  # auto never picks flex


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex is refused on the CPU: this is its CUDA proof")
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # GQA; a sliding window and softcapping
def test_flex_packed_equals_separate_forward_on_cuda(model_type):
    """The packed flex forward against each sequence alone under SDPA; the control runs the packed row without its
    boundaries (positions running on across sequences) and must differ."""
    model = tiny_model(model_type).cuda()
    seqs = sequences(LENGTHS)
    batch = padfree.pack_result_to_tensors(padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs).to("cuda")
    with torch.no_grad():
        configure_packing(model, backend="sdpa")
        alone = [model(input_ids=torch.tensor([s], device="cuda")).logits[0] for s in seqs]
        configure_packing(model, backend="flex_attention")
        packed = model(**batch.model_inputs(include_labels=False)).logits
        padfree.unconfigure_packing(model)
        leaked = model(input_ids=batch.input_ids, use_cache=False).logits
    starts = batch.cu_seqlens[:-1].tolist()
    rows = torch.repeat_interleave(torch.arange(batch.input_ids.shape[0]), batch.seqs_per_row.cpu()).tolist()
    row_start = {r: starts[rows.index(r)] for r in set(rows)}
    worst = control = 0.0
    for i, sid in enumerate(batch.sequence_ids.tolist()):
        r, c, n = rows[i], starts[i] - row_start[rows[i]], len(seqs[sid])
        worst = max(worst, float((packed[r, c:c + n] - alone[sid]).abs().max()))
        control = max(control, float((leaked[r, c:c + n] - alone[sid]).abs().max()))
    assert worst <= ATOL
    assert control > 100 * ATOL
