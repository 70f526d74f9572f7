"""A sweep file, typed and expanded into points, checked before anything trains.

A sweep is data (``sweeps/*.yaml``)::

    name: isoflop_tiny
    profile: tiny                  # the base profile every point starts from
    settings:                      # overlay on that profile for every point
      pretrain: {sequence_len: 64}
    grid:                          # the cross product of these lists is the set of points
      pretrain.target_flops: [3e11, 1e12]
      pretrain.depth: [1, 2, 3]
    stages: [data, tokenizer, pretrain]
    metrics: [pretrain.val_bpb, pretrain.tokens]
    concurrency: 2

Each point's settings are the base profile, then ``settings``, then its grid values, validated by the
same section models the stages use (:data:`chatpipe.settings.SECTIONS`), so a typo fails here,
naming the point and the key, instead of in the tenth training run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chatpipe.settings import SECTIONS, ParamsError, deep_merge, pipeline_stages, read_settings_yaml, resolve_params

# Sections that say where a point runs or logs, not what it computes: never part of a point's identity.
PLACEMENT_SECTIONS = ("launch", "tracking")


def point_stages() -> tuple[str, ...]:
    """Stages a point can run, in pipeline order (``report``/``export`` are per-project, not per-point)."""
    return tuple(s for s in pipeline_stages() if s not in ("report", "export"))


class SweepSettings(BaseModel):
    """The typed content of a sweep file (unknown top-level keys are errors)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    profile: str = "tiny"
    settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    grid: dict[str, list[Any]]
    stages: list[str] = Field(default_factory=lambda: ["data", "tokenizer", "pretrain"])
    metrics: list[str] = Field(default_factory=lambda: ["pretrain.val_bpb", "pretrain.tokens"])
    concurrency: int = Field(1, ge=1)
    description: str = ""

    @field_validator("grid")
    @classmethod
    def _grid_not_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not grid:
            raise ValueError("the grid is empty: name at least one `section.key: [values]`")
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid key {key!r} has no values")
            if key.count(".") != 1:
                raise ValueError(f"grid key {key!r}: expected `section.key` (e.g. pretrain.depth)")
        return grid

    @field_validator("stages")
    @classmethod
    def _stages_in_order(cls, stages: list[str]) -> list[str]:
        allowed = point_stages()
        unknown = [s for s in stages if s not in allowed]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; allowed: {', '.join(allowed)}")
        if not stages:
            raise ValueError("no stages: a point must run at least one")
        ordered = sorted(set(stages), key=allowed.index)
        later = [s for s in ordered if allowed.index(s) > allowed.index("tokenizer")]
        missing = [s for s in ("data", "tokenizer") if s not in ordered]
        if later and missing:  # a point prepares its own inputs: every later stage reads data and tokenizer
            raise ValueError(f"stages {stages} need {missing} too (before {later[0]})")
        return ordered


@dataclass
class Point:
    """One grid point: its grid values and its fully resolved params (every section)."""

    values: dict[str, Any]
    params: dict[str, Any]
    name: str = ""
    counts: dict[str, float] = field(default_factory=dict)  # params, FLOPs/token, steps (from the horizon)


def point_name(values: dict[str, Any]) -> str:
    """A readable directory-name prefix: ``depth2-target_flops1e+12``."""
    parts = []
    for key, value in values.items():
        short = key.split(".", 1)[1]
        shown = f"{value:.3g}".replace("+", "") if isinstance(value, float) else str(value)
        parts.append(f"{short}{shown}")
    return "-".join(parts).replace("/", "_")


def load_sweep(path: Path) -> SweepSettings:
    """Read and type-check a sweep file; a ParamsError names the file and the bad key."""
    raw = read_settings_yaml(Path(path)) or {}  # UTF-8, no key twice; errors name the file and line
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: a sweep file is a mapping (profile, stages, settings, grid), got {raw!r}")
    try:
        return SweepSettings.model_validate(raw)
    except ValidationError as err:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg']}" for e in err.errors()]
        raise ParamsError(f"{path}: invalid sweep\n  " + "\n  ".join(lines)) from None


def _coerce(value: Any) -> Any:
    """YAML reads ``1e18`` as a string (it wants ``1.0e+18``); accept what people write."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def expand(sweep: SweepSettings, params_file: Path | None = None) -> list[Point]:
    """The points of the sweep's grid, each with its resolved settings, validated (before any training)."""
    base = deep_merge(resolve_params(params_file, sweep.profile), sweep.settings)
    keys = list(sweep.grid)
    points = []
    for combo in itertools.product(*(sweep.grid[k] for k in keys)):
        values = {k: _coerce(v) for k, v in zip(keys, combo)}
        overlay: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            section, name = key.split(".", 1)
            overlay.setdefault(section, {})[name] = value
        point = Point(values, deep_merge(base, overlay), point_name(values))
        validate_point(point)
        points.append(point)
    return points


def check(cls, values: dict[str, Any]):
    """``values`` through a section model alone: no env, no params file (a settings model's own
    ``model_validate`` reads both, and re-reads params.yaml for every section of every point)."""
    return cls.__pydantic_validator__.validate_python(values)


def validate_point(point: Point) -> None:
    """Every section through its settings model (unknown keys, types, ranges), then the training horizon."""
    for section, values in point.params.items():
        if section == "profile":
            continue
        cls = SECTIONS.get(section)
        if cls is None:
            raise ParamsError(f"point {point.name}: unknown settings section {section!r}; allowed: {sorted(SECTIONS)}")
        try:
            check(cls, values or {})
        except ValidationError as err:
            lines = []
            for e in err.errors():
                what = "unknown settings key" if e["type"] == "extra_forbidden" else e["msg"]
                if not e["loc"]:  # a check across keys: the values would only bury the message
                    lines.append(f"{section}: {what}")
                    continue
                lines.append(f"{section}.{'.'.join(str(p) for p in e['loc'])} = {e.get('input')!r}: {what}")
            raise ParamsError(f"point {point.name}: invalid settings\n  " + "\n  ".join(lines)) from None
    point.counts = horizon_counts(point)


def horizon_counts(point: Point) -> dict[str, float]:
    """The point's model counts and steps from the same horizon derivation pretrain uses (meta device, no memory).

    A budget too small for one optimizer step is an error naming the point: nanochat would silently train 0 steps.
    """
    from chatpipe.settings import LaunchSettings, PretrainSettings
    from chatpipe.train.pretrain_plan import horizon_for, plan_counts

    cfg = check(PretrainSettings, point.params.get("pretrain") or {})
    launch = check(LaunchSettings, point.params.get("launch") or {})
    vocab = int((point.params.get("tokenizer") or {}).get("vocab_size", 1024))
    try:
        counts = plan_counts(cfg, vocab)
        horizon = horizon_for(cfg, counts, launch.nnodes * launch.nproc_per_node)
    except ValueError as e:
        raise ParamsError(f"point {point.name}: {e}") from None
    if horizon.num_iterations < 1:
        raise ParamsError(
            f"point {point.name}: pretrain.target_flops = {cfg.target_flops:.3g} is too small for one step "
            f"({horizon.flops_per_token:,} FLOPs/token x {horizon.total_batch_size:,} tokens/step = "
            f"{horizon.flops_per_token * horizon.total_batch_size:.3g} FLOPs); raise it or shrink the model"
        )
    tokens = horizon.num_iterations * horizon.total_batch_size
    return {
        "scaling_params": horizon.scaling_params,
        "total_params": counts.run.num_params,
        "flops_per_token": horizon.flops_per_token,
        "steps": horizon.num_iterations,
        "total_batch_size": horizon.total_batch_size,
        "tokens": tokens,
        "flops": float(horizon.flops_per_token) * tokens,
    }


def price(points: list[Point], peak_flops: float, mfu: float) -> dict[str, float]:
    """Total pretraining FLOPs of the points and the GPU-hours they take at ``mfu`` of ``peak_flops``."""
    flops = math.fsum(p.counts["flops"] for p in points)
    return {"points": len(points), "flops": flops, "gpu_hours": flops / (peak_flops * mfu) / 3600}


def format_plan(sweep: SweepSettings, points: list[Point], gpu: str = "H100", mfu: float = 0.4) -> str:
    """The grid with each point's model size, steps and FLOPs, and the whole sweep's GPU-hours."""
    from chatpipe.train.step import PEAK_FLOPS

    lines = [
        f"sweep {sweep.name}: {len(points)} points, stages {', '.join(sweep.stages)}, concurrency {sweep.concurrency}"
    ]
    for p in points:
        c = p.counts
        lines.append(
            f"  {p.name:28s} N {c['scaling_params']:>13,.0f} (total {c['total_params']:>13,.0f})  "
            f"{c['steps']:>7,} steps x {c['total_batch_size']:>9,}  {c['flops']:.3g} FLOPs"
        )
    priced = price(points, PEAK_FLOPS[gpu], mfu)
    lines.append(f"  total {priced['flops']:.3g} FLOPs = {priced['gpu_hours']:,.1f} {gpu} GPU-hours at {mfu:.0%} MFU")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``chatpipe sweep-plan sweeps/<name>.yaml [--gpu H100 --mfu 0.4]``: validate and price; 2 on bad input."""
    import argparse
    import sys

    from chatpipe.train.step import PEAK_FLOPS

    p = argparse.ArgumentParser(prog="chatpipe sweep-plan", description="validate a sweep file and price its points")
    p.add_argument("sweep")
    p.add_argument("--gpu", default="H100", choices=sorted(PEAK_FLOPS))
    p.add_argument("--mfu", type=float, default=0.4)
    args = p.parse_args(argv)
    try:
        sweep = load_sweep(Path(args.sweep))
        print(format_plan(sweep, expand(sweep), args.gpu, args.mfu))
    except ParamsError as e:
        print(f"chatpipe sweep-plan: {e}", file=sys.stderr)
        return 2
    return 0
