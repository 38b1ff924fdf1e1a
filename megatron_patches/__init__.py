"""The only code that reaches into Megatron-Core internals. Entry point: `apply()`.

(placeholder: the CPU/gloo shims are being written; see issue 2)
"""


def apply() -> None:
    """Apply the CPU/gloo shims once per process (no-op when CUDA is present)."""
