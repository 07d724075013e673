"""``remat.stage`` (placeholder until the runtime lands: runs plainly)."""

__all__ = ["stage"]


def stage(obj):
    return obj
