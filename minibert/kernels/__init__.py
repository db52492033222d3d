"""Triton kernels, each file a lesson: reference -> kernel -> launcher -> test -> benchmark."""
import triton
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


def interpreting() -> bool:
    """True under Triton's CPU interpreter: TRITON_INTERPRET=1 was set when triton.jit ran, so every kernel
    is an InterpretedFunction and runs on CPU tensors. Asking a kernel, not os.environ, keeps the
    environment out of the code and answers what the kernels really are."""
    return isinstance(_probe, InterpretedFunction)
