"""Each row's adapter as data: both adapters' LoRA matrices stacked per layer, one row mask per forward pass.

PEFT applies one active adapter to the whole batch (or, with `adapter_names`, loops over adapters and rows: about
a thousand extra kernel launches per step on a 3B model). Here every LoRA layer computes

    base(x) + ((x @ A_all.T) * row_mask) @ B_all.T

where A_all stacks every adapter's A (rank blocks side by side), B_all every adapter's B, and row_mask keeps, for
each row, only its own adapter's rank block, scaled by the adapter's LoRA scaling (folded into B instead where an
adapter's scaling differs between layers), so PEFT's own weights can become views into the stacks. That is the
same few kernels per layer whatever the mix, and the mask is an ordinary tensor, so the step stays capturable as a
CUDA graph. Rank blocks are padded with zeros where an adapter does not touch a layer or has a smaller rank there
(docs/architecture.md §14).
"""

from __future__ import annotations

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from worker.decoder.kernels import lora_expand

NO_ADAPTER = -1  # a row index that selects no adapter (the bare base model)
SPARE = "#spare-"  # the name of a block no role holds yet (never a role's name: those start with a letter)


def _compute_dtype(base: torch.nn.Module) -> torch.dtype:
    """The dtype a base layer's output has: bitsandbytes' 4-bit layers compute in `compute_dtype`."""
    compute = getattr(base, "compute_dtype", None)
    if isinstance(compute, torch.dtype):
        return compute
    return base.weight.dtype if base.weight.dtype.is_floating_point else torch.float32


def _uniform_scaling(layers: list[LoraLayer], name: str) -> float | None:
    """The adapter's LoRA scaling if every layer it touches has the same one, else None."""
    scales = {layer.scaling[name] for layer in layers if name in layer.lora_A}
    return scales.pop() if len(scales) == 1 else None


class RowLoRA:
    """Installed on a PeftModel: its own LoRA path is switched off and replaced by the row-selected one until
    `remove()`. One instance per model; the decoder calls `select` before every forward pass."""

    # Set by a profiler's user (the benchmark's kernel census): each LoRA product then runs in a range so named.
    profile_label: str | None = None

    def __init__(self, model: PeftModel, adapters: list[str], dtype: torch.dtype | None = None,
                 masked_expand: bool = False, min_rank: int = 0, spare: int = 0):
        """`dtype`: the LoRA products' dtype, by default the dtype the base layers compute in. PEFT keeps adapter
        weights in fp32 beside a 4-bit base, which costs a cast each way and fp32 (SIMT) matmuls per layer.
        `masked_expand`: the mask and the expand as one kernel where it applies (worker/decoder/kernels/lora_expand.py).
        `min_rank`: each adapter's rank block is at least this wide (zeros past its own rank), so an adapter of up
        to that rank can later `replace` it in place. `spare`: blocks of zeros as wide as the widest, which roles
        loaded at run time under new names `take`."""
        if getattr(model, "_row_lora", None) is not None:  # its hooks and the other's would both add a delta
            raise RuntimeError("this model already serves a decoder: close that decoder first")
        self.model, self.adapters = model, [*adapters, *(f"{SPARE}{i}" for i in range(spare))]
        self.dtype, self.masked_expand = dtype, masked_expand
        self.names = {m: name for name, m in model.named_modules() if isinstance(m, LoraLayer)}  # as PEFT saves them
        self.layers = list(self.names)
        if not self.layers:
            raise ValueError("the model has no LoRA layers")
        for layer in self.layers:
            unsupported = [n for n in adapters if n in getattr(layer, "lora_variant", {})]
            if unsupported:  # DoRA and the like change the base output, not just add to it
                raise ValueError(f"adapters {unsupported} use a LoRA variant this engine does not apply per row")
        # Widest rank block of each adapter over all layers, so one mask fits every layer.
        self.ranks = [max([min_rank, *(layer.r.get(n, 0) for layer in self.layers)]) for n in adapters]
        self.ranks += [max(self.ranks, default=min_rank)] * spare
        self.offsets = [sum(self.ranks[:i]) for i in range(len(self.adapters))]
        self.width = sum(self.ranks)
        # An adapter whose scaling is the same in every layer (the usual case) has it in its mask row, so its B
        # stays PEFT's own and PEFT's weights can be views into the stacks: the adapters held once, not twice.
        # Otherwise its scaling is folded into each layer's B (a copy) and its mask row is 1.
        self.scales = [_uniform_scaling(self.layers, name) for name in self.adapters]
        # Per LoRA layer: (A_all, B_all), rank blocks side by side (worker/decoder/kernels/fused_projections.py joins them).
        self.stacked: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self.layers:
            self.restack(layer, *self._stack(layer))
        first = next(iter(self.stacked.values()))[0]
        # One mask row per adapter, its rank block set (to its scaling, or 1); the last (NO_ADAPTER) selects nothing.
        self._table = torch.zeros(len(self.adapters) + 1, self.width, dtype=first.dtype, device=first.device)
        for index, (offset, rank, scale) in enumerate(zip(self.offsets, self.ranks, self.scales)):
            self._table[index, offset:offset + rank] = 1 if scale is None else scale
        self.mask = torch.zeros(1, 1, self.width, dtype=first.dtype, device=first.device)
        self._hooks = [layer.register_forward_hook(self._add_delta) for layer in self.layers]
        for layer in self.layers:
            layer.enable_adapters(False)  # the layer now computes base(x) only; the hook adds the rows' LoRA
        model._row_lora = self

    def _stack(self, layer: LoraLayer) -> tuple[torch.Tensor, torch.Tensor]:
        base = layer.get_base_layer()
        a_blocks, b_blocks = [], []
        for name, rank in zip(self.adapters, self.ranks):
            if name in layer.lora_A:
                a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
                if self.scales[self.adapters.index(name)] is None:
                    b = b * layer.scaling[name]
                pad = rank - a.shape[0]
                a = torch.cat([a, a.new_zeros(pad, a.shape[1])]) if pad else a
                b = torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1) if pad else b
            else:
                reference = next(iter(layer.lora_A.values())).weight
                a = reference.new_zeros(rank, base.in_features)
                b = reference.new_zeros(base.out_features, rank)
            a_blocks.append(a)
            b_blocks.append(b)
        dtype = self.dtype or _compute_dtype(base)
        return (torch.cat(a_blocks).detach().to(dtype).contiguous(),
                torch.cat(b_blocks, dim=1).detach().to(dtype).contiguous())

    def restack(self, layer: LoraLayer, a: torch.Tensor, b: torch.Tensor) -> None:
        """Make (a, b) the layer's stacked matrices, and PEFT's weights of the layer views into them where they
        hold the same values in the same dtype, so that no second copy of an adapter stays on the device."""
        self.stacked[layer] = (a, b)
        for name, offset, scale in zip(self.adapters, self.offsets, self.scales):
            if name not in layer.lora_A or scale is None:
                continue
            own_a, own_b = layer.lora_A[name].weight, layer.lora_B[name].weight
            if own_a.dtype == a.dtype and own_a.device == a.device:
                rank = own_a.shape[0]
                own_a.data, own_b.data = a[offset:offset + rank], b[:, offset:offset + rank]

    def replace(self, name: str, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Copy a new version of adapter `name` into its rank block of every layer, in place: the same storage, so
        the captured graphs, the joined projections' stacks and PEFT's views all read the new weights; a layer
        it does not change gets zeros, and so do the columns past its rank (B·A is the same with zero rows of A
        and zero columns of B). `weights`: (A, B) by module name, as PEFT saves them; `scaling`: its alpha / r.
        Rows of `name` must not run meanwhile (the engine switches at a safe point, docs/architecture.md §10).
        ValueError, with nothing copied, when a matrix does not fit."""
        index = self.adapters.index(name)
        offset, rank = self.offsets[index], self.ranks[index]
        # the mask row holds the scaling it was built with (or 1 where it is folded into B): fold the difference
        factor = scaling / (self.scales[index] if self.scales[index] is not None else 1.0)
        by_name = {module: layer for layer, module in self.names.items()}
        if unknown := sorted(set(weights) - set(by_name)):
            raise ValueError(f"it changes modules this decoder holds no LoRA for: {', '.join(unknown[:3])}")
        for module, (a, b) in weights.items():
            a_all, b_all = self.stacked[by_name[module]]
            if a.shape[0] > rank or a.shape[1] != a_all.shape[1] or tuple(b.shape) != (b_all.shape[0], a.shape[0]):
                raise ValueError(f"{module}: A {list(a.shape)} and B {list(b.shape)} do not fit its rank block "
                                 f"({rank} wide, {a_all.shape[1]} in, {b_all.shape[0]} out)")
        with torch.no_grad():
            for layer in self.layers:
                a_all, b_all = self.stacked[layer]
                block_a, block_b = a_all[offset:offset + rank], b_all[:, offset:offset + rank]
                block_a.zero_()
                block_b.zero_()
                if (new := weights.get(self.names[layer])) is not None:
                    a, b = new
                    block_a[:a.shape[0]].copy_(a)
                    block_b[:, :a.shape[0]].copy_(b if factor == 1.0 else b * factor)

    def take(self, name: str) -> None:
        """Give a spare block to the new role `name` (its weights come with `replace`); ValueError when none is
        left. The block keeps its place, so the captured graphs and each row's index stay valid."""
        spare = next((i for i, held in enumerate(self.adapters) if held.startswith(SPARE)), None)
        if spare is None:
            raise ValueError("every spare block is taken (KEVLAYA_MODEL__SPARE_ROLES): unload a role first")
        self.adapters[spare] = name

    def release(self, name: str) -> None:
        """Zero `name`'s block and make it spare again. Rows of `name` must not run meanwhile."""
        index = self.adapters.index(name)
        self.replace(name, {}, 1.0)
        self.adapters[index] = f"{SPARE}{index}"

    def _rows(self, adapter_of_row: torch.Tensor) -> torch.Tensor:
        """Each row's mask (rows × 1 × width), gathered from the per-adapter table on its device."""
        return self._table.index_select(0, adapter_of_row.remainder(self._table.shape[0]))[:, None, :]  # -1: last

    def select(self, adapter_of_row: list[int]) -> None:
        """Set each row's adapter (an index into `adapters`, or NO_ADAPTER) for the next forward passes."""
        self.mask = self._rows(torch.tensor(adapter_of_row, device=self._table.device))

    def select_in_place(self, adapter_of_row: list[int], buffer: torch.Tensor) -> None:
        """`select` into a preallocated buffer (rows × 1 × width), so a captured graph sees the new rows."""
        self.select_on_device(torch.tensor(adapter_of_row, device=buffer.device), buffer)

    def select_on_device(self, adapter_of_row: torch.Tensor, buffer: torch.Tensor) -> None:
        """`select_in_place` with each row's adapter already on the device: nothing is copied from the host, so
        the caller need not wait for the GPU."""
        buffer.copy_(self._rows(adapter_of_row))
        self.mask = buffer

    def new_buffer(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, 1, self.width, dtype=self.mask.dtype, device=self.mask.device)

    def _add_delta(self, layer: LoraLayer, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.add(args[0], output, *self.stacked[layer])

    def add(self, x: torch.Tensor, output: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            boundaries: tuple[int, ...] = ()) -> torch.Tensor:
        """`output` plus each row's LoRA product ((x @ a.T) * row mask) @ b.T. `a` may stack several projections'
        rank blocks (projections joined by input, worker/decoder/kernels/fused_projections.py), each taking the row mask:
        the output columns from `boundaries[k - 1]` on are then expanded from block k (`b` stays out × width)."""
        if RowLoRA.profile_label is not None:
            with torch.profiler.record_function(RowLoRA.profile_label):
                return self._add(x, output, a, b, boundaries)
        return self._add(x, output, a, b, boundaries)

    def _add(self, x: torch.Tensor, output: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             boundaries: tuple[int, ...]) -> torch.Tensor:
        shrunk = x.to(a.dtype) @ a.T
        if self.masked_expand and lora_expand.takes(output, shrunk, self.mask, b, boundaries):
            lora_expand.masked_expand(output, shrunk, self.mask, b, boundaries)
            return output
        if boundaries:  # each member's columns expand from its own rank block, into the base output
            blocks = shrunk.unflatten(-1, (len(boundaries) + 1, self.width)) * self.mask.unsqueeze(-2)
            edges = [0, *boundaries, output.shape[-1]]
            for k, (first, last) in enumerate(zip(edges, edges[1:])):
                output[..., first:last] += (blocks[..., k, :] @ b[first:last].T).to(output.dtype)
            return output
        shrunk = shrunk * self.mask
        if output.dtype != a.dtype:
            return output + (shrunk @ b.T).to(output.dtype)
        # expand and add as one GEMM into the base output (C += shrunk @ B): out of place, cuBLAS would first copy
        # C, a kernel per LoRA product; the base output is this pass's own fresh tensor
        flat = output.reshape(-1, output.shape[-1])
        flat.addmm_(shrunk.reshape(-1, shrunk.shape[-1]), b.T)
        return flat.view(output.shape)

    def remove(self) -> None:
        if getattr(self.model, "_row_lora", None) is not self:
            return  # removed already (a decoder may be closed twice)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for layer in self.layers:
            layer.enable_adapters(True)
        self.model._row_lora = None
