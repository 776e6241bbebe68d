"""Slapo's ``slapo.utils.common``: the hooks a module carries, by sync mode."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...schedule._state import _PostHook, _PreHook, state_of

HOOK_MODES = ("fwd_pre", "fwd_post", "bwd_post")


def get_hooks(mod: nn.Module) -> dict[str, list[Callable]]:
    """``{"fwd_pre": [...], "fwd_post": [...], "bwd_post": [...]}``: the forward pre-hooks, the
    forward hooks and the backward hooks registered on ``mod``, and the syncs slapo-tune's
    ``sync`` attached to it (which run from one pre-hook and one forward hook of its own, listed
    here once per sync, under the sync's mode, as Slapo's one hook per sync was)."""
    st = state_of(mod)

    def users(registered) -> list[Callable]:
        return [h for h in registered.values() if not isinstance(h, _PreHook | _PostHook)]

    hooks: dict[str, list[Callable]] = {
        "fwd_pre": users(mod._forward_pre_hooks),
        "fwd_post": users(mod._forward_hooks),
        "bwd_post": list(mod._backward_hooks.values()),
    }
    if st is not None:
        for sync in [*st.pre_syncs, *st.post_syncs]:
            hooks[sync.mode].append(sync.apply)
    return hooks


__all__ = ["HOOK_MODES", "get_hooks"]
