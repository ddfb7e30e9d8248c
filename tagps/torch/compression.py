"""Gradient compression applied around every transfer (Horovod's interface: ``compress`` / ``decompress``)."""

from __future__ import annotations

import torch

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Turn a tensor into what travels, and back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Return the tensor to send and the context :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """Return the received ``tensor`` in its original form."""
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class _CastCompressor(Compressor):
    """Send floating-point tensors wider than ``wire`` as ``wire``; leave other dtypes alone."""

    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        if tensor.is_floating_point() and torch.finfo(tensor.dtype).bits > torch.finfo(cls.wire).bits:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)  # type: ignore[arg-type]


class FP16Compressor(_CastCompressor):
    """Send float32/float64 tensors as float16 (relative error about 2**-11 per element and hop)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Send float32/float64 tensors as bfloat16 (float32's range, relative error about 2**-8)."""

    wire = torch.bfloat16


class Compression:
    """The available compressors, named as in Horovod and BytePS."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
