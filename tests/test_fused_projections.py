"""Projections that share an input joined into one matmul (worker/decoder/kernels/fused_projections.py): the same numbers
as each projection alone, on NF4 and dense weights, with LoRA on some members only, and the model given back."""

from __future__ import annotations

import uuid

import pytest
import torch

from modellab.model_factory import build_random_model
from modellab.reference import ReferenceRuntime
from shared.settings import Settings
from worker.decoder.kernels.fused_projections import (
    FusedProjections,
    _dense_matmul,
    _joined,
    _nf4_matmul,
    decoded_scales_bytes,
    join_weights,
)
from worker.decoder.kernels.row_lora import RowLoRA
from worker.decoder.options import DecoderOptions
from worker.decoder.slot_decoder import SlotDecoder
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest

PROMPTS = ["Pick a laptop under 900 EUR.", "Train or plane to Lyon?", "Hire Ana or Ben?", "Rent or buy?", "Go?"]


def nf4_layers(sizes: list[int], features: int, compute_dtype: torch.dtype = torch.float32) -> list[torch.nn.Module]:
    import bitsandbytes as bnb

    layers = []
    for out in sizes:
        layer = bnb.nn.Linear4bit(features, out, bias=True, compute_dtype=compute_dtype, compress_statistics=True,
                                  quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(out, features), requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")._quantize("cpu")
        layer.bias = torch.nn.Parameter(torch.randn(out), requires_grad=False)
        layers.append(layer)
    return layers


def nf4_product(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's product through bitsandbytes' own dequantization (its double-quantized scales decoded anew)."""
    import bitsandbytes.functional as bnbf

    weight = bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    return torch.nn.functional.linear(x, weight, layer.bias)


def dense_layers(sizes: list[int], features: int) -> list[torch.nn.Module]:
    return [torch.nn.Linear(features, out, bias=True) for out in sizes]


@pytest.mark.parametrize("kind", ["nf4-scales-kept-decoded", "nf4-scales-decoded-per-call", "dense"])
def test_joined_weights_multiply_exactly_as_each_projection_alone(kind: str) -> None:
    """Double-quantized NF4 scales from three tensors cannot share one 8-bit offset: the join keeps them decoded,
    or decodes each member's at every call; either must give bit for bit the weights bitsandbytes decodes itself.
    Biases are joined too."""
    torch.manual_seed(0)
    sizes, features = [256, 128, 64], 256
    nf4 = kind.startswith("nf4")
    layers = nf4_layers(sizes, features) if nf4 else dense_layers(sizes, features)
    product = nf4_product if nf4 else (lambda layer, x: layer(x))
    x = torch.randn(3, 5, features)
    with torch.no_grad():
        alone = [product(layer, x) for layer in layers]
        matmul = _nf4_matmul(layers, kind == "nf4-scales-kept-decoded") if nf4 else _dense_matmul(layers)
        # more rows go member by member on NF4; one row reads the joined weight with the joined scales
        for expected, got in zip(alone, matmul(x).split(sizes, dim=-1), strict=True):
            assert torch.equal(expected, got)
        one = x[:1, :1]
        for layer, got in zip(layers, matmul(one).split(sizes, dim=-1), strict=True):
            assert torch.equal(product(layer, one), got)
        # each member's weight is now a view into the joined one, and computes as before on its own
        assert layers[1].weight.data_ptr() > layers[0].weight.data_ptr()
        assert all(torch.equal(product(layer, x), expected) for layer, expected in zip(layers, alone))


def test_what_kept_decoded_scales_cost_is_known_before_joining() -> None:
    """The worker weighs it against a slot before it joins: 3 more bytes per 64 weights of each NF4 member."""
    torch.manual_seed(0)
    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = nf4_layers([256, 128, 128], 256)
    assert decoded_scales_bytes(attention) == 3 * (256 + 128 + 128) * 256 // 64
    assert decoded_scales_bytes(torch.nn.Sequential(*dense_layers([8], 8))) == 0


def test_a_join_keeps_the_scales_the_worker_chose() -> None:
    """The worker joins with the kind of scales its memory allows; a decoder built after must use that join, not
    join again with scales kept decoded."""
    torch.manual_seed(0)
    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = layers = nf4_layers([128, 64, 64], 128)
    x = torch.randn(2, 3, 128)
    with torch.no_grad():
        expected = torch.cat([nf4_product(layer, x) for layer in layers], dim=-1)
        assert join_weights(attention, decoded_scales=False) == 1
        per_call = _joined(layers)
        assert _joined(layers) is per_call and torch.equal(per_call(x), expected)
        join_weights(attention, decoded_scales=True)  # asked for the other kind: joined again
        assert _joined(layers) is not per_call and torch.equal(_joined(layers)(x), expected)


def test_a_join_that_decodes_scales_per_call_holds_no_decoded_scales() -> None:
    """Per-call scales exist so that a card short of memory does not pay for float32 scales: nothing the join keeps
    (the matmul, the NF4 kernel's view of the weight) may hold them between calls; the kept kind must. fp16 compute,
    as on CUDA, so the kernel's weight is built too."""
    import gc

    torch.manual_seed(0)
    sizes, features = [320, 192, 192], 128  # 1,408 scale blocks: a size no other tensor here has
    blocks = sum(sizes) * features // 64

    def decoded_alive() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float32
                   and o.numel() == blocks)

    for kept in (True, False):
        matmul = _nf4_matmul(nf4_layers(sizes, features, torch.float16), decoded_scales=kept)
        assert matmul is not None
        assert decoded_alive() == (1 if kept else 0), f"decoded_scales={kept}"
        del matmul


@pytest.mark.parametrize("kept", [True, False], ids=["scales-kept-decoded", "scales-decoded-per-call"])
def test_a_joined_nf4_prefill_dequantizes_a_slice_of_one_members_weight_at_a_time(kept: bool,
                                                                                   monkeypatch) -> None:  # noqa: ANN001
    """A product of more than one row dequantizes the weight into fp16 first: given the joined weight whole, a
    prefill would hold the whole group's (gate and up: twice the largest member), the largest memory a prefill
    takes. It goes member by member, each in slices of at most DEQUANTIZED_SLICE_BYTES (here 64 rows); one row
    (bitsandbytes' GEMV reads the packed weight) may take the joined weight."""
    import bitsandbytes
    import bitsandbytes.functional as bnbf

    from worker.decoder.kernels import nf4_matmul

    torch.manual_seed(0)
    sizes, features = [256, 128, 64], 128
    layers = nf4_layers(sizes, features)
    x = torch.randn(16, features)
    with torch.no_grad():
        expected = torch.cat([nf4_product(layer, x) for layer in layers], dim=-1)
    monkeypatch.setattr(nf4_matmul, "DEQUANTIZED_SLICE_BYTES", 64 * features * 4)  # float32 weights here
    multiply, dequantize, whole, sliced = bitsandbytes.matmul_4bit, bnbf.dequantize_4bit, [], []

    def handed(x, weight, quant_state, **kwargs):  # noqa: ANN001, ANN003, ANN202
        whole.append((x.numel() // x.shape[-1], quant_state.shape[0]))
        return multiply(x, weight, quant_state=quant_state, **kwargs)

    def dequantized(packed, quant_state=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        sliced.append(quant_state.shape[0])
        return dequantize(packed, quant_state, *args, **kwargs)

    monkeypatch.setattr(bitsandbytes, "matmul_4bit", handed)
    monkeypatch.setattr(bnbf, "dequantize_4bit", dequantized)
    matmul = _nf4_matmul(layers, kept)
    decode_scales, scales_decoded = bnbf.dequantize_blockwise, []
    monkeypatch.setattr(bnbf, "dequantize_blockwise", lambda *args, **kwargs: scales_decoded.append(True) or
                        decode_scales(*args, **kwargs))
    with torch.no_grad():
        assert torch.allclose(matmul(x), expected, atol=1e-4)
        assert bool(scales_decoded) != kept  # kept scales are not decoded again at each call, member by member
        assert matmul(torch.randn(1, features)).shape == (1, sum(sizes))
    assert sliced == [64] * 4 + [64] * 2  # the two larger members, a slice at a time
    assert [out for rows, out in whole if rows == 16] == [64]  # the smallest is one slice: bitsandbytes' own path
    assert [out for rows, out in whole if rows == 1] == [sum(sizes)]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRuntime:
    """Adapters on q_proj and v_proj only: the q/k/v group joins members with LoRA and one without."""
    dirs = build_random_model(tmp_path_factory.mktemp("fused"), "tiny", seed=3, target_modules=("q_proj", "v_proj"))

    def profile(name: str) -> dict[str, object]:
        return dict(path=str(dirs[name]), max_new_tokens=24)

    return ReferenceRuntime.load(Settings(_env_file=None, model={"base": str(dirs["base"]), "device": "cpu"},
                                          kev=profile("kev"), laya=profile("laya")))


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(job_id=uuid.uuid4(), adapter=("kev", "laya")[i % 2],
                              messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                              max_new_tokens=n, temperature=0.0, top_p=1.0, seed=None)
            for i, n in enumerate([24, 9, 17, 24, 5, 12])]


@pytest.mark.parametrize("static_steps", [False, True], ids=["eager-steps", "static-steps"])
def test_a_decoder_with_joined_projections_answers_as_one_without(runtime: ReferenceRuntime,
                                                                  static_steps: bool) -> None:
    answers = {}
    for fused in (False, True):
        decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=3, window=128,
                              eos_ids=runtime.eos_ids,
                              options=DecoderOptions(static_steps=static_steps, fused_projections=fused))
        try:
            if fused:  # q/k/v and gate/up in each of the two layers
                assert decoder.fused.groups == 2 * runtime.model.config.num_hidden_layers
            answers[fused] = run_to_end(decoder, requests())
        finally:
            decoder.close()
    assert {len(r.token_ids) for r in answers[False]} != {24}  # rows ended at different steps
    for alone, joined in zip(answers[False], answers[True], strict=True):
        assert joined.token_ids == alone.token_ids
        assert joined.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-5)


def test_closing_the_decoder_gives_the_model_back_its_own_projections(runtime: ReferenceRuntime) -> None:
    attention = runtime.model.base_model.model.model.layers[0].self_attn
    own = [attention.q_proj, attention.k_proj, attention.v_proj]
    before = runtime.run_batch(requests()[:2]).results
    decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=2, window=128,
                          eos_ids=runtime.eos_ids)
    assert attention.q_proj is not own[0]
    decoder.close()
    assert [attention.q_proj, attention.k_proj, attention.v_proj] == own
    after = runtime.run_batch(requests()[:2]).results
    assert [r.token_ids for r in after] == [r.token_ids for r in before]


def test_a_member_called_on_another_input_computes_its_own(runtime: ReferenceRuntime) -> None:
    """Only the input the group's first member just saw is shared; any other goes through the member's own layer."""
    attention = runtime.model.base_model.model.model.layers[0].self_attn
    features = runtime.model.config.hidden_size
    x, other = torch.randn(1, 3, features), torch.randn(1, 3, features)
    lora = RowLoRA(runtime.model, ["kev", "laya"])
    try:
        lora.select([0])
        with torch.no_grad():
            expected = {"x": attention.v_proj(x), "other": attention.v_proj(other)}
            fused = FusedProjections(runtime.model, lora)
            try:
                attention.q_proj(x)
                assert torch.allclose(attention.v_proj(other), expected["other"], atol=1e-6)
                assert torch.allclose(attention.v_proj(x), expected["x"], atol=1e-6)
            finally:
                fused.remove()
    finally:
        lora.remove()


def test_a_joined_members_lora_is_held_once_in_the_groups_tensors(runtime: ReferenceRuntime) -> None:
    """A joined member's stacked LoRA becomes a view into its group's joined matrices: the adapters are held once,
    not twice (84 MB on a 7B model, which a 6 GB card's slots need), and the group's B is no larger than its
    members' (block-diagonal, it held 65 MiB of zeros on 7B). What the member computes alone is the test above's."""
    lora = RowLoRA(runtime.model, ["kev", "laya"])
    try:
        fused = FusedProjections(runtime.model, lora)
        try:
            with_lora = [(parent, name, member) for parent, name, member in fused._swapped if member in lora.stacked]
            assert with_lora
            for parent, name, member in with_lora:
                group = getattr(parent, name).group
                a, b = lora.stacked[member]
                assert a.untyped_storage().data_ptr() == group.lora_a.untyped_storage().data_ptr(), name
                assert b.untyped_storage().data_ptr() == group.lora_b.untyped_storage().data_ptr(), name
                assert group.lora_b.shape == (sum(group.sizes), lora.width)  # as compact as one layer's B
        finally:
            fused.remove()
    finally:
        lora.remove()


def test_peft_keeps_no_copy_of_the_adapters_beside_the_decoders_stacks(runtime: ReferenceRuntime) -> None:
    """While a decoder serves, PEFT's LoRA weights are views into its stacked matrices (each adapter's scaling is in
    its mask row, not folded into B): the adapters are held once (on a 7B model PEFT's copy was 114 MiB more).
    Closed, the model answers through PEFT exactly as before."""
    before = runtime.run_batch(requests()[:3]).results
    decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=2, window=128,
                          eos_ids=runtime.eos_ids)
    try:
        shared = 0
        for layer, (a, b) in decoder.lora.stacked.items():
            for name in ("kev", "laya"):
                if name in layer.lora_A:
                    assert layer.lora_A[name].weight.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                    assert layer.lora_B[name].weight.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                    shared += 1
        assert shared == 2 * 2 * runtime.model.config.num_hidden_layers  # q and v, both adapters
    finally:
        decoder.close()
    after = runtime.run_batch(requests()[:3]).results
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    for b, a in zip(before, after, strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-6)


def test_an_adapter_whose_scaling_differs_between_layers_answers_as_peft_does(runtime: ReferenceRuntime) -> None:
    """Where an adapter's LoRA scaling is not the same in every layer (PEFT's alpha or rank patterns), its mask
    row cannot carry it: it is folded into each layer's B (a copy of B, not a view), and answers stay PEFT's."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in runtime.model.modules() if isinstance(m, LoraLayer) and "kev" in m.lora_A]
    original = layers[0].scaling["kev"]
    layers[0].scaling["kev"] = original * 3
    try:
        expected = runtime.run_batch(requests()).results
        decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=3, window=128,
                              eos_ids=runtime.eos_ids)
        try:
            assert decoder.lora.scales[0] is None and decoder.lora.scales[1] == layers[0].scaling["laya"]
            got = run_to_end(decoder, requests())
        finally:
            decoder.close()
    finally:
        layers[0].scaling["kev"] = original
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def test_the_weights_are_joined_once_per_model(runtime: ReferenceRuntime) -> None:
    """The worker builds several decoders while it sizes its slots: each must reuse the join, not copy the weights
    again (the copy before would stay with whoever still held the old decoder)."""
    attention = runtime.model.base_model.model.model.layers[0].self_attn

    def addresses() -> list[int]:
        decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=2, window=64,
                              eos_ids=runtime.eos_ids)
        decoder.close()
        return [p.weight.data_ptr() for p in (attention.q_proj, attention.k_proj, attention.v_proj)]

    first = addresses()
    assert first[1] - first[0] == attention.q_proj.weight.nbytes  # joined: k right after q
    assert addresses() == first


def test_a_joined_step_runs_fewer_matmuls_and_copies_no_base_output(runtime: ReferenceRuntime) -> None:
    """What the GPU census counts, on the CPU: joined, a layer runs 4 base matmuls instead of 7; and each LoRA
    expand adds into the base output in place (out of place, `addmm` first copies it: one more kernel per product).
    On CUDA a group's expand is one kernel for all its members (worker/decoder/kernels/lora_expand.py); here, without it,
    one product per member's rank block."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for fused in (False, True):
        decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=2, window=128,
                              eos_ids=runtime.eos_ids, options=DecoderOptions(fused_projections=fused))
        try:
            decoder.prefill(requests()[:2])
            decoder.step()  # this step, and the next one launched ahead
            with profile(activities=[ProfilerActivity.CPU]) as recorded:
                decoder.step()  # the step launched ahead chosen from, and one more launched: one forward pass
        finally:
            decoder.close()
        events = list(recorded.events())
        assert not [e for e in events if e.name == "aten::copy_" and e.cpu_parent is not None
                    and e.cpu_parent.name.startswith("aten::addmm")]
        counts[fused] = sum(e.name == "aten::linear" for e in events)
    layers = runtime.model.config.num_hidden_layers
    # unfused: 7 base products a layer; joined: 4 (q/k/v, o, gate/up, down)
    assert counts[False] - counts[True] == layers * (7 - 4)