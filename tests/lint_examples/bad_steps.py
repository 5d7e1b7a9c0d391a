"""Steps with one capture hazard each (plus the value-dependent ones, which have two).

Each factory returns (step, example_inputs) or (step, example_inputs, alt_inputs); the tests
check that the linter names the right hazard at the line marked `# <- hazard`.
"""

import numpy as np
import torch

BUCKET = 4


def _x():
    return torch.arange(BUCKET, dtype=torch.float32) - 1.5  # [-1.5, -0.5, 0.5, 1.5]


def _slots():
    return torch.tensor([3, 5, 0, 0])


def item_sync():
    def step(x):
        scale = x.max().item()  # <- hazard
        return x * scale

    return step, (_x(),)


def bool_branch():
    def step(x):
        if (x > 0).all():  # <- hazard
            return x
        return -x

    return step, (_x(),)


def int_of_tensor():
    def step(x, n):
        return x * int(n)  # <- hazard

    return step, (_x(), torch.tensor(2))


def index_of_tensor():
    def step(x, n):
        return (x, x * 2)[n]  # <- hazard

    return step, (_x(), torch.tensor(1))


def tolist_sync():
    def step(table, slots):
        return [table[s] for s in slots.tolist()]  # <- hazard

    return step, (torch.zeros(8), _slots())


def numpy_sync():
    def step(x):
        return x * float(np.sum(x.numpy()))  # <- hazard

    return step, (_x(),)


def cpu_copy():
    def step(x):
        return x.cpu()  # <- hazard

    return step, (_x(),)


def to_cpu_string():
    def step(x):
        return x.to("cpu", non_blocking=True)  # <- hazard

    return step, (_x(),)


def to_cpu_keyword():
    def step(x):
        return x.to(device="cpu")  # <- hazard

    return step, (_x(),)


def cuda_synchronize():
    def step(x):
        y = x * 2
        torch.cuda.synchronize()  # <- hazard
        return y

    return step, (_x(),)


def cudart_stream_query():
    """Querying any stream or event inside a capture invalidates it (a no-op without a GPU)."""
    from cuda.bindings import runtime as cudart

    def step(x):
        cudart.cudaStreamQuery(0)  # <- hazard
        return x * 2

    return step, (_x(),)


def print_tensor():
    def step(x):
        print(f"x = {x}")  # <- hazard
        return x

    return step, (_x(),)


def _max_of(x):
    return x.max().item()  # <- hazard


def sync_in_helper():
    """The hazard's line is the innermost user frame: the helper, not the step."""

    def step(x):
        return x * _max_of(x)

    return step, (_x(),)


def nonzero_shape():
    def step(x):
        return torch.nonzero(x > 0)  # <- hazard

    return step, (_x(),)


def bool_mask_index():
    def step(x):
        return x[x > 0]  # <- hazard

    return step, (_x(),)


def bool_mask_assign():
    def step(x):
        x[x < 0] = 0.0  # <- hazard
        return x

    return step, (_x(),)


def masked_select_shape():
    def step(x):
        return torch.masked_select(x, x > 0)  # <- hazard

    return step, (_x(),)


def unique_shape():
    def step(slots):
        return torch.unique(slots)  # <- hazard

    return step, (_slots(),)


def repeat_interleave_unsized():
    def step(x, counts):
        return torch.repeat_interleave(x, counts)  # <- hazard

    return step, (_x(), torch.tensor([1, 2, 1, 0]))


def one_hot_unsized():
    def step(slots):
        return torch.nn.functional.one_hot(slots)  # <- hazard

    return step, (_slots(),)


def multinomial_sampling():
    """multinomial checks its probabilities with a host read inside the CUDA kernel."""

    def step(probs):
        return torch.multinomial(probs, 1)  # <- hazard

    return step, (torch.full((BUCKET, 8), 0.125),)


def python_list_tensor():
    def step(x):
        return x + torch.tensor([1.0, 2.0, 3.0, 4.0])  # <- hazard

    return step, (_x(),)


def as_tensor_list():
    def step(x):
        return x * torch.as_tensor([0.5] * BUCKET)  # <- hazard

    return step, (_x(),)


def from_numpy_array():
    def step(x):
        return x + torch.from_numpy(np.ones(BUCKET, dtype=np.float32))  # <- hazard

    return step, (_x(),)


def list_index():
    """A list index becomes a CPU tensor inside __getitem__: a pageable copy on the GPU."""

    def step(x):
        return x[[0, 2]]  # <- hazard

    return step, (_x(),)


def list_column_index():
    def step(table):
        return table[:, [1, 3]]  # <- hazard

    return step, (torch.randn(BUCKET, 8),)


def range_index():
    def step(x):
        return x[range(2)]  # <- hazard

    return step, (_x(),)


def numpy_index():
    def step(x):
        return x[np.array([3, 1])]  # <- hazard

    return step, (_x(),)


def list_index_assign():
    """The 0.0 is fine (a device fill on the GPU); the list of rows is not."""

    def step(x):
        x[[0, 2]] = 0.0  # <- hazard
        return x

    return step, (_x(),)


def value_dependent_branch():
    """`if x.sum() > 0` syncs, and other values take the other branch: both are reported."""

    def step(x):
        if x.sum() > 0:  # <- hazard
            return x * 2
        return x + 1  # <- other branch

    return step, (_x() + 1,), (_x() - 1,)


def value_dependent_shape():
    """The output's shape follows the values: a replay could not honour it."""

    def step(counts):
        return torch.arange(16)[: counts.sum()]  # <- hazard

    return step, (torch.tensor([1, 2, 3, 0]),)


def raises_on_example():
    def step(x):
        return x @ torch.ones(BUCKET + 1)

    return step, (_x(),)


def not_a_pair():
    return lambda x: x


def step_not_callable():
    return 42, (_x(),)


NOT_CALLABLE = 3
