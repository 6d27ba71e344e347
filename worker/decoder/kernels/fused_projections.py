"""Projections that read one input run as one matmul: q/k/v in attention, gate/up in the MLP.

A decoder layer calls `q_proj`, `k_proj` and `v_proj` on the same hidden state (and `gate_proj`, `up_proj` on
the same one), each a small matmul plus its rows' LoRA. While installed, the group's first projection computes
every member's output at once: one base matmul over the members' weights concatenated by output, and one LoRA
shrink, mask and expand for all members and both adapters. (On NF4 a prefill's many rows still multiply member by
member: bitsandbytes dequantizes a whole weight before it multiplies them, and one member's is the smaller
transient.) The others return their slice of that output; called
on any other input they compute their own, as before.

The weights are joined once per model (`join_weights`, which the worker calls before it measures its memory):
the members' own weights become views into the joined ones, so memory does not grow. On NF4 the members'
double-quantized block scales cannot be joined as they are (each tensor's 8-bit scales have their own offset),
so the joined weight either keeps them decoded in float32 (`decoded_scales=True`: 3 bytes more per 64 weights,
about 85 MB on a 3B model, and no decoding per call), or keeps each member's 8-bit scales and decodes them into
float32 at each call (two small kernels per member and a concatenation; no memory). Both give exactly the values
bitsandbytes decodes itself. The worker takes the first unless its memory would cost a slot (docs/architecture.md
§14).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from weakref import WeakKeyDictionary

import torch
from peft.tuners.lora import LoraLayer

from worker.decoder.kernels import nf4_matmul as nf4_kernel
from worker.decoder.kernels.nf4_matmul import Nf4Weight, sliced_matmul
from worker.decoder.kernels.row_lora import RowLoRA

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

Matmul = Callable[[torch.Tensor], torch.Tensor]

# Per group's first base layer: the members' weight addresses once joined, whether NF4 scales are kept decoded,
# and the joined matmul. A decoder rebuilt on the same model (the worker sizes its slots by building several)
# reuses the join instead of copying the weights again, which would leave the previous copy to whoever still held
# the old decoder.
_JOINED: WeakKeyDictionary[torch.nn.Module, tuple[list[int], bool, Matmul]] = WeakKeyDictionary()


def _base(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_layer() if isinstance(module, LoraLayer) else module


def _share_storage(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along their first dimension; each becomes a view into the result."""
    joined = torch.cat([t.data for t in tensors])
    offset = 0
    for tensor in tensors:
        rows = tensor.shape[0]
        tensor.data = joined[offset:offset + rows]
        offset += rows
    return joined


def _joined_bias(bases: list[torch.nn.Module], dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if all(b.bias is None for b in bases):
        return None
    parts = [b.bias.data if b.bias is not None else b.weight.new_zeros(b.out_features, dtype=dtype)
             for b in bases]
    return torch.cat([p.to(dtype) if dtype else p for p in parts])


def _dense_matmul(bases: list[torch.nn.Module]) -> Matmul | None:
    if not all(type(b) is torch.nn.Linear for b in bases):
        return None
    weight, bias = _share_storage([b.weight for b in bases]), _joined_bias(bases)
    return lambda x: torch.nn.functional.linear(x, weight, bias)


def _nf4_states(bases: list[torch.nn.Module]) -> list | None:
    """The members' NF4 quantization states, if they can be joined."""
    states = [getattr(b.weight, "quant_state", None) for b in bases]
    if any(s is None for s in states):
        return None
    first = states[0]
    same = all(s.quant_type == first.quant_type and s.blocksize == first.blocksize and s.dtype == first.dtype
               and s.shape[1] == first.shape[1] and (s.shape[0] * s.shape[1]) % s.blocksize == 0
               and not getattr(s, "packing_format_for_cpu", False) for s in states)
    return states if same and len({b.compute_dtype for b in bases}) == 1 else None


def _nf4_matmul(bases: list[torch.nn.Module], decoded_scales: bool) -> Matmul | None:
    states = _nf4_states(bases)
    if states is None:
        return None
    import bitsandbytes
    import bitsandbytes.functional as bnbf

    first, compute_dtype = states[0], bases[0].compute_dtype
    shape = torch.Size([sum(s.shape[0] for s in states), first.shape[1]])
    packed = _share_storage([b.weight for b in bases])
    bias, sizes = _joined_bias(bases, compute_dtype), [s.shape[0] for s in states]

    def joined_state():  # noqa: ANN202 (bitsandbytes' QuantState)
        scales = torch.cat([nf4_kernel.decoded_scales(s) for s in states])
        return bnbf.QuantState(absmax=scales, shape=shape, code=first.code, blocksize=first.blocksize,
                               quant_type=first.quant_type, dtype=first.dtype)

    kept = joined_state() if decoded_scales else None
    # each member's state for a prefill's products: with its slice of the kept scales, else its own (decoded there)
    members = states
    if kept is not None:
        ends = list(itertools.accumulate(s.shape.numel() // s.blocksize for s in states))
        members = [bnbf.QuantState(absmax=kept.absmax[end - s.shape.numel() // s.blocksize:end], shape=s.shape,
                                   code=s.code, blocksize=s.blocksize, quant_type=s.quant_type, dtype=s.dtype)
                   for s, end in zip(states, ends)]

    def state():  # noqa: ANN202 (bitsandbytes' QuantState): the scales kept, else this call's
        return kept if kept is not None else joined_state()

    # the joined weight as the NF4 kernel reads it (None: a weight or dtype it does not take); its scales are the
    # ones kept, or, decoded per call, none between calls: each call's go in their place
    kernel_weight = None
    if compute_dtype in (None, torch.float16):
        kernel_weight = Nf4Weight.from_state(packed, state())
        if kernel_weight is not None and kept is None:
            kernel_weight = dataclasses.replace(kernel_weight, absmax=kernel_weight.absmax.new_empty(0))

    def matmul(x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if kernel_weight is not None and nf4_kernel.takes(x):
            weight = kernel_weight if kept is not None else dataclasses.replace(kernel_weight,
                                                                                 absmax=state().absmax)
            return nf4_kernel.kernel_matmul(x, weight, bias)
        x = x.to(compute_dtype) if compute_dtype is not None else x
        # looked up on the module at each call, so a profiler's wrapper (the bench's census) sees it
        if x.numel() == x.shape[-1]:  # one row: bitsandbytes' GEMV reads the packed weight as it is
            return bitsandbytes.matmul_4bit(x, packed, quant_state=state(), bias=bias).to(dtype)
        # More rows (a prefill): the weight is dequantized into fp16 first, so member by member and in slices
        # (sliced_matmul): the largest memory a prefill takes is then a slice, not the group's whole weight.
        biases = bias.split(sizes) if bias is not None else [None] * len(bases)
        return torch.cat([sliced_matmul(x, b.weight, member, member_bias)
                          for b, member, member_bias in zip(bases, members, biases)], dim=-1).to(dtype)

    return matmul


def decoded_scales_bytes(model: torch.nn.Module) -> int:
    """The memory joining with `decoded_scales=True` adds: float32 scales where the members keep 8-bit ones."""
    total = 0
    for _, _, members in _groups(model):
        states = _nf4_states([_base(m) for m in members])
        total += sum(3 * s.absmax.numel() for s in states or [] if s.nested)
    return total


class _Group:
    """One set of projections sharing an input: the joined matmul, the joined LoRA, and the last outputs."""

    def __init__(self, matmul: Matmul, members: list[torch.nn.Module], lora: RowLoRA):
        self.matmul, self.lora = matmul, lora
        self.sizes = [_base(m).out_features for m in members]
        with_lora = [(i, m) for i, m in enumerate(members) if m in lora.stacked]
        self.lora_a = self.lora_b = None
        self.boundaries: tuple[int, ...] = ()
        if with_lora:
            stacks = [lora.stacked[m] for _, m in with_lora]
            a = torch.cat([a for a, _ in stacks])
            # one B for all members, as compact as one layer's: member i's output rows hold its own B, and read its
            # own rank block of the joined shrink (the expand's `boundaries`: where each member after the first
            # with LoRA begins); a member without LoRA keeps zero rows
            b = a.new_zeros(sum(self.sizes), lora.width)
            starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
            for block, ((i, member), (member_a, member_b)) in enumerate(zip(with_lora, stacks)):
                rows = slice(starts[i], starts[i] + self.sizes[i])
                b[rows] = member_b
                # the member's own stack becomes a view into the joined one: one copy of the adapters, not two
                lora.restack(member, a[block * member_a.shape[0]:(block + 1) * member_a.shape[0]], b[rows])
            self.lora_a, self.lora_b = a, b
            self.boundaries = tuple(starts[i] for i, _ in with_lora[1:])
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor] = []

    def lead(self, x: torch.Tensor) -> torch.Tensor:
        output = self.matmul(x)
        if self.lora_a is not None:
            output = self.lora.add(x, output, self.lora_a, self.lora_b, self.boundaries)
        self.input, self.outputs = x, list(output.split(self.sizes, dim=-1))
        return self.outputs[0]

    def follow(self, index: int, x: torch.Tensor, own: torch.nn.Module) -> torch.Tensor:
        if x is not self.input:
            return own(x)
        output = self.outputs[index]
        if index == len(self.sizes) - 1:  # the last member: hold no activation past the layer
            self.input, self.outputs = None, []
        return output


class _Member(torch.nn.Module):
    """Stands in for one projection of a group while installed."""

    def __init__(self, group: _Group, index: int, own: torch.nn.Module):
        super().__init__()
        self.group, self.index = group, index
        object.__setattr__(self, "own", own)  # not a child: the model's modules stay the original ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            return self.group.lead(x)
        return self.group.follow(self.index, x, self.own)


def _groups(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, tuple[str, ...], list[torch.nn.Module]]]:
    """(parent, member names, members) of each group of projections present in full."""
    for parent in list(model.modules()):
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, torch.nn.Module) and not isinstance(m, _Member) for m in members):
                yield parent, names, members


def _joined(members: list[torch.nn.Module], decoded_scales: bool | None = None) -> Matmul | None:
    """The members' joined matmul, joining their weights the first time, or again where `decoded_scales` asks for
    the other kind of scales (None: whichever the join has, kept decoded if new); None where they cannot be
    joined."""
    bases = [_base(m) for m in members]
    addresses = [b.weight.data_ptr() for b in bases]
    known = _JOINED.get(bases[0])
    if known is not None and known[0] == addresses and decoded_scales in (None, known[1]):
        return known[2]
    if len({(b.in_features, b.weight.device) for b in bases}) != 1:
        return None
    decoded = decoded_scales is not False
    matmul = _nf4_matmul(bases, decoded) or _dense_matmul(bases)
    if matmul is not None:
        _JOINED[bases[0]] = ([b.weight.data_ptr() for b in bases], decoded, matmul)  # the joined addresses
    return matmul


def join_weights(model: torch.nn.Module, decoded_scales: bool = True) -> int:
    """Join every group's weights now (once per model; later calls find them joined) and give the memory the
    members' own copies held back to the device: the worker calls it before it measures what the model holds.
    `decoded_scales`: NF4 scales kept decoded (faster) or decoded at each call (smaller). Returns the number of
    groups joined."""
    joined = sum(_joined(members, decoded_scales) is not None for _, _, members in _groups(model))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return joined


class FusedProjections:
    """Installed on a model by the decoder after its RowLoRA; `remove()` puts the original modules back (their
    weights stay views into the joined ones, so the model computes exactly as before)."""

    def __init__(self, model: torch.nn.Module, lora: RowLoRA):
        self._swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
        self.groups = 0
        try:
            for parent, names, members in _groups(model):
                matmul = _joined(members)
                if matmul is None:
                    continue
                group = _Group(matmul, members, lora)
                self.groups += 1
                for index, (name, member) in enumerate(zip(names, members)):
                    setattr(parent, name, _Member(group, index, member))
                    self._swapped.append((parent, name, member))
        except BaseException:
            self.remove()  # nothing half-installed
            raise

    def remove(self) -> None:
        for parent, name, member in self._swapped:
            setattr(parent, name, member)
        self._swapped.clear()
