"""gift-compile: geometry-informed FP8 gradient communication (GIFT) as a PyTorch compiler pass."""

from gift_compile.agreement import GiftConfigMismatch
from gift_compile.backend import GiftBackend, default_backend, gift_backend
from gift_compile.config import GiftConfig
from gift_compile.reference import GiftReducer, GiftReference
from gift_compile.replicate import replicate

__all__ = ["GiftBackend", "GiftConfig", "GiftConfigMismatch", "GiftReducer", "GiftReference", "default_backend", "gift_backend", "replicate"]
