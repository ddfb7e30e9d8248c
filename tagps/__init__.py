"""tagps: topology-aware graph deployment (TAG) on a BytePS-style communication runtime."""

__version__ = "0.1.0"

__all__ = ["__version__"]
