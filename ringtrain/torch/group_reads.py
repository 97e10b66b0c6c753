"""What a grouped allreduce of torch tensors reads from its tensors to find the core's plan for the group.

    signature, members = group_reads.read(tensors)     # tensors: a list; raises what a tensor's getter raises

signature: one (dtype, shape, is_cpu) per tensor (the plan's key with the call's name, op and scales); members:
their data_ptr()s, where the core's plan reads them, or None when one is not contiguous (no plan then). On a small
recurring group these reads are a visible share of the call, and most of what Python adds to torch's getters is the
interpreter's per-attribute and per-call work: the compiled module's read_group (csrc/express_group.c) makes the
same reads in one call, and `read` is that function once the module is built (else read_python, the same in Python).
"""
import operator

import torch

from ringtrain.core import grouped

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_plain_signature = operator.attrgetter("dtype", "shape", "is_cpu")     # a recurring group's key, per tensor


def read_python(tensors):
    """read() without the compiled module."""
    signature = tuple(map(_plain_signature, tensors))
    return signature, (tuple(map(_data_ptr, tensors)) if all(map(_is_contiguous, tensors)) else None)


def _first_read(tensors):
    """read()'s first call: makes `read` the compiled reader when the module is built, else read_python."""
    global read
    read = grouped.compiled_reader() or read_python
    return read(tensors)


read = _first_read
