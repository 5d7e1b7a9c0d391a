"""The README's linter example: a step with capture hazards, and its fixed-shape rewrite."""

import torch


def make_step():
    table = torch.zeros(9, 4)  # [max_reqs + 1, width], slot 0 = padding

    def step(slots, values):
        if (slots == 0).all():  # "empty batch": early return
            return
        live = slots[slots != 0]  # drop the padding rows
        table[live] = values[: live.shape[0]]

    return step, (torch.tensor([3, 5, 0, 0]), torch.randn(4, 4))


def make_fixed_step():
    table = torch.zeros(9, 4)

    def step(slots, values):
        keep = (slots != 0)[:, None]  # [bs, 1]
        table.index_copy_(0, slots, torch.where(keep, values, table[0]))

    return step, (torch.tensor([3, 5, 0, 0]), torch.randn(4, 4))
