"""Pre-quantized (checkpoint-format) FP8 in an update request, and the request's control entries.

Trainers that quantize on their side (verl's SGLang rollout, slime, Miles, AReaL) send ``<prefix>.weight`` as
``torch.float8_e4m3fn`` codes [N, K] together with ``<prefix>.weight_scale_inv``, float32 [ceil(N/128), ceil(K/128)]
(the dequantization multipliers of 128x128 blocks). :func:`attach_scales` pairs them: each scale rides on its codes
(``SCALE_ATTR``) through the model's own ``load_weights`` to our loaders, which store blockwise layers exactly as sent
and re-quantize the BF16 value of the codes elsewhere (layers/fp8_storage.py). Refused, naming the tensor: a weight
without its scale or a scale without its weight, a scale of the wrong dtype or shape, a scale that is NaN, Inf, 0 or
negative, codes holding the NaN encoding (0x7F / 0xFF), FP8 dtypes other than E4M3 (the dtype check).

Control entries (names starting with ``fp8rl.``) carry no weights: ``STEP_COMPLETE`` marks the last request of a
trainer step (the client sends it). Their names, and the scale suffix, are the wire protocol's
(:mod:`sglang_fp8rl.weight_sync.protocol`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from sglang_fp8rl.layers.fp8_storage import SCALE_ATTR
from sglang_fp8rl.quant import DEFAULT_BLOCK_SIZE, FP8_DTYPE, blockwise_scale_shape
from sglang_fp8rl.weight_sync.protocol import CONTROL_NAMES, CONTROL_PREFIX, SCALE_SUFFIX, is_scale_name
from sglang_fp8rl.weight_sync.validate import UpdateRejected

_NAN_CODE = 0x7F  # E4M3FN has no Inf; S.1111.111 (0x7F, 0xFF) is its only NaN


def split_control(named: Sequence[tuple[Any, Any]]) -> tuple[list[tuple[Any, Any]], set[str]]:
    """The weight entries of a request, and the control entries it carries."""
    weights, control = [], set()
    for name, tensor in named:
        if isinstance(name, str) and name.startswith(CONTROL_PREFIX):
            if name not in CONTROL_NAMES:
                raise UpdateRejected(f"{name}: unknown control entry (known: {CONTROL_NAMES})")
            control.add(name)
        else:
            weights.append((name, tensor))
    return weights, control


def attach_scales(named: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The request with each ``weight_scale_inv`` attached to its FP8 codes and removed from the list; rejects
    unpaired or malformed pre-quantized tensors. Requests without FP8 codes come back unchanged."""
    by_name = {name: t for name, t in named if isinstance(name, str)}
    codes = {n for n, t in by_name.items() if isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE}
    scales = {n for n in by_name if is_scale_name(n)}
    if not codes and not scales:
        return list(named)
    for name in sorted(codes):
        if name + SCALE_SUFFIX not in scales:
            raise UpdateRejected(f"{name}: float8_e4m3fn codes need {name + SCALE_SUFFIX} in the same update")
    for name in sorted(scales):
        weight = weight_of(name)
        if weight not in codes:
            got = getattr(by_name.get(weight), "dtype", "nothing")
            raise UpdateRejected(f"{name}: a scale needs {weight} as float8_e4m3fn codes in the same update, got "
                                 f"{got} (fp8_online_blockwise computes the scales of BF16 weights itself)")
    pairs = [(by_name[n], check_scale_shape(n, by_name[n], by_name[n + SCALE_SUFFIX]), n) for n in sorted(codes)]
    check_values(pairs)
    block_scales = {name: scale for _, scale, name in pairs}
    out = []
    for name, tensor in named:
        if name in scales:
            continue
        out.append((name, with_scale(tensor, block_scales[name]) if name in codes else tensor))
    return out


@dataclasses.dataclass(frozen=True)
class Pairing:
    """One request matched against the halves held from earlier requests of its step (see :func:`complete_pairs`)."""

    named: list  # the request, with each held partner it completes added (ready for attach_scales)
    hold: dict  # name -> tensor: halves of this request whose partner has not arrived yet
    taken: tuple[str, ...] = ()  # held names this request completes
    superseded: tuple[str, ...] = ()  # held names this request replaces (their weight again: BF16, a pair, a half)


def weight_of(name: str) -> str:
    """The weight a half belongs to: a scale's weight, or the weight itself."""
    return name[: -len(SCALE_SUFFIX)] if is_scale_name(name) else name


def partner_name(name: str) -> str:
    """The other half's name: a weight's scale, or a scale's weight."""
    return weight_of(name) if is_scale_name(name) else name + SCALE_SUFFIX


def without_partners(names: Iterable[str]) -> str:
    """Each half with the partner it waits for, for a message."""
    return ", ".join(f"{name} without {partner_name(name)}" for name in names)


def _is_half(name: Any, tensor: Any) -> bool:
    return is_scale_name(name) or (isinstance(tensor, torch.Tensor) and tensor.dtype == FP8_DTYPE)


def superseded_halves(named: Sequence[tuple[Any, Any]], held: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Held halves that a request replaces: it carries the same half again, or their weight as a BF16 tensor or as a
    whole pair (the newer tensor of a parameter wins; the held half would otherwise pair with the wrong partner)."""
    tensors = {name: tensor for name, tensor in named if isinstance(name, str)}
    out = []
    for name in held:
        weight = weight_of(name)
        bf16_weight = weight in tensors and not _is_half(weight, tensors[weight])
        whole_pair = weight in tensors and weight + SCALE_SUFFIX in tensors
        if name in tensors or bf16_weight or whole_pair:
            out.append(name)
    return tuple(sorted(out))


def complete_pairs(named: Sequence[tuple[Any, Any]], held: Mapping[str, torch.Tensor]) -> Pairing:
    """Pair FP8 codes and scales across the requests of a step (verl's buckets split them): a half whose partner is
    held joins it here; a half whose partner is neither here nor held is to be held; a held half the request
    replaces is superseded. A scale whose weight came in this request as BF16 is left for :func:`attach_scales` to
    refuse. Changes nothing."""
    names = {name for name, _ in named if isinstance(name, str)}
    superseded = superseded_halves(named, held)
    out, hold, taken = list(named), {}, []
    for name, tensor in named:
        if not isinstance(name, str) or not _is_half(name, tensor):
            continue
        partner = partner_name(name)
        if partner in names:
            continue
        if partner in held and partner not in superseded:
            out.append((partner, held[partner]))
            taken.append(partner)
        else:
            hold[name] = tensor
    return Pairing([item for item in out if not (isinstance(item[0], str) and item[0] in hold)], hold, tuple(taken),
                   superseded)


def with_scale(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A view of ``codes`` carrying its scale (a view of its own: the attribute never leaks to the caller's tensor)."""
    view = codes.view(codes.shape)
    setattr(view, SCALE_ATTR, scale)
    return view


def pair_stream(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`attach_scales` over a stream (a checkpoint read file by file): FP8 codes and their scales are held
    until both have arrived (checkpoints store them side by side); a partner missing at the end is rejected."""
    held_codes: dict[str, torch.Tensor] = {}
    held_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and tensor.dtype == FP8_DTYPE:
            held_codes[name] = tensor
        elif is_scale_name(name):
            held_scales[weight_of(name)] = tensor
        else:
            yield name, tensor
            continue
        weight = weight_of(name)
        if weight in held_codes and weight in held_scales:
            codes, scale = held_codes.pop(weight), held_scales.pop(weight)
            scale = check_scale_shape(weight, codes, scale)
            check_values([(codes, scale, weight)])
            yield weight, with_scale(codes, scale)
    leftovers = {**{n: v for n, v in held_codes.items()}, **{n + SCALE_SUFFIX: v for n, v in held_scales.items()}}
    if leftovers:
        attach_scales(list(leftovers.items()))  # raises, naming the first tensor without its partner
        raise UpdateRejected(f"{sorted(leftovers)[0]}: pre-quantized tensor without its partner")


def check_scale_shape(name: str, codes: torch.Tensor, scale: Any) -> torch.Tensor:
    """The scale as a float32 tensor of one value per 128x128 block of the codes; UpdateRejected otherwise. A 1-D
    scale of a weight with a single column block (K <= 128: verl's Triton quantizer drops that dimension) is taken as
    that one column, the only reading its shape allows."""
    if codes.dim() != 2:
        raise UpdateRejected(f"{name}: pre-quantized codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    want = blockwise_scale_shape(tuple(codes.shape), DEFAULT_BLOCK_SIZE)
    if isinstance(scale, torch.Tensor) and scale.dim() == 1 and want[1] == 1 and scale.shape[0] == want[0]:
        scale = scale.unsqueeze(1)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
        got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise UpdateRejected(f"{name}{SCALE_SUFFIX}: expected float32 of shape {want} (one per 128x128 block of "
                             f"{tuple(codes.shape)}), got {got}")
    return scale


def check_values(pairs: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
    """Codes without the NaN encoding and scales finite and > 0; one host sync per device for the request."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for codes, scale, _ in pairs:
        bad_code = ((codes.view(torch.uint8) & _NAN_CODE) == _NAN_CODE).any()
        bad_scale = ~(torch.isfinite(scale) & (scale > 0)).all().to(bad_code.device)
        flags.setdefault(bad_code.device, []).append(torch.stack((bad_code, bad_scale)))
    bad = {device: torch.stack(f).cpu() for device, f in flags.items()}
    seen: dict[torch.device, int] = {}
    for codes, scale, name in pairs:
        device = codes.device
        bad_code, bad_scale = bad[device][seen.get(device, 0)].tolist()
        seen[device] = seen.get(device, 0) + 1
        if bad_code:
            raise UpdateRejected(f"{name}: float8_e4m3fn codes hold the NaN encoding (0x7F/0xFF)")
        if bad_scale:
            raise UpdateRejected(f"{name}{SCALE_SUFFIX}: scales must be finite and > 0 (min {scale.min().item()}, "
                                 f"max {scale.max().item()})")
