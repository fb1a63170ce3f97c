"""gift-compile: geometry-informed FP8 gradient communication (GIFT) as a PyTorch compiler pass."""

from gift_compile.backend import GiftBackend, gift_backend
from gift_compile.config import GiftConfig
from gift_compile.reference import GiftReducer, GiftReference
from gift_compile.replicate import replicate
from gift_compile.runtime import get_runtime

__all__ = ["GiftBackend", "GiftConfig", "GiftReducer", "GiftReference", "get_runtime", "gift_backend", "replicate"]
