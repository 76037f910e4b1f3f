"""The routed experts of a model as mlx-lm builds it: its switch layers, their paths, expert counts and
experts per token (docs/formats.md, "Which tensors are experts").

Nothing here guesses config keys or tensor names. ``switch_layers`` builds the architecture's ``Model``
from config.json with mlx-lm's own classes, shape-only: every parameter is replaced by a broadcast zero
(one element of memory, whatever its shape) before anything could evaluate it, and one token runs through
the model lazily with every SwitchGLU / SwitchMLP watched. The number of experts is the leading dimension
of a switch layer's weights; the experts per token is the last dimension of the indices its router hands
it. No array is evaluated, so building a 600B-parameter model this way costs no weight memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from moe_l2.atomic_file import AtomicFile

__all__ = ["SwitchLayer", "switch_layers", "build_in_child_processes", "decoder_layer", "set_module"]

log = logging.getLogger("moe-l2.model")

# The daemon never touches Metal (docs/architecture.md, "Native module"), but building a model asks MLX for
# a few constants, so the daemon builds in a short-lived child process instead (build_in_child_processes).
_IN_CHILD = False
_CHILD = ("import json, sys\nfrom moe_l2.model.architecture import _switch_layers_here as f\n"
          "try:\n    layers = f(**json.load(sys.stdin))\nexcept ValueError as e:\n    sys.exit(f'ValueError: {e}')\n"
          "print(json.dumps([l.__dict__ for l in layers]))")
# The shape-only build stops past this many modules per tensor of the model's files (and a few more): mlx-lm's
# models make one to two per tensor, so only a config.json that names far more layers or experts than the files
# hold gets there (each layer costs about 160 KB and 1 ms to build; a million of them would take the machine).
_MODULES_PER_TENSOR = 8
_MODULES_AT_LEAST = 256

# The first list index in a module path is its decoder layer: model.layers.3.mlp..., transformer.h.3.moe...
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class SwitchLayer:
    """One routed-expert layer of the model mlx-lm builds."""

    path: str  # module path of the SwitchGLU / SwitchMLP: its parameters are "<path>.<projection>.<param>"
    layer: int  # the decoder layer it belongs to (the first list index in the path: "layers.N", "h.N")
    projections: tuple[str, ...]  # its switch-linear children, e.g. gate_proj, up_proj, down_proj or fc1, fc2
    n_experts: int  # the leading dimension of its weights
    top_k: int  # experts per token: the last dimension of the indices its router passes to it
    rows: tuple[int, ...]  # each projection's output size (its weight's second dimension), in projections' order


class _TooManyModules(ValueError):
    """config.json makes mlx-lm build far more modules than the model's files have tensors for."""


@contextmanager
def _modules_at_most(limit: int | None):
    """Count the modules mlx-lm's constructors make, and stop them past limit (None: no limit)."""
    import mlx.nn as nn

    if limit is None:
        yield
        return
    made = 0
    init = nn.Module.__init__

    def counted(module, *args, **kwargs):
        nonlocal made
        made += 1
        if made > limit:
            raise _TooManyModules(f"config.json makes mlx-lm build more than {limit} modules, far more than the "
                                  "model's files have tensors for: a layer or expert count in it does not belong "
                                  "to these files (damaged or edited?)")
        init(module, *args, **kwargs)

    nn.Module.__init__ = counted
    try:
        yield
    finally:
        nn.Module.__init__ = init


# What importing mlx_lm.utils sets RLIMIT_NOFILE to (mlx_lm/utils.py: "For large models with lots of files").
MLX_LM_FILES = (2048, 4096)


def _mlx_lm_utils():
    """mlx_lm.utils, imported (with the package, which imports it), or a ValueError that names the cause where its
    import-time setrlimit fails: under a hard open-files limit below MLX_LM_FILES[1] only a privileged process may
    raise it, and mlx-lm's own message ("not allowed to raise maximum limit") names neither the limit nor mlx-lm."""
    import resource

    try:
        from mlx_lm import utils
    except ValueError:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if hard == resource.RLIM_INFINITY or hard >= MLX_LM_FILES[1]:
            raise
        raise ValueError(f"mlx-lm sets the open-files limit to {MLX_LM_FILES[0]} soft, {MLX_LM_FILES[1]} hard when it "
                         f"is imported, and this process' hard limit is {hard}, which only a privileged process may "
                         f"raise: raise the hard limit to {MLX_LM_FILES[1]} or more (LimitNOFILE={MLX_LM_FILES[1]} in "
                         f"the systemd unit, ulimit -Hn {MLX_LM_FILES[1]} in the shell that starts it)") from None
    return utils


def _build(config: dict, tensors: int | None):
    import mlx.core as mx
    from mlx.utils import tree_map

    _get_classes = _mlx_lm_utils()._get_classes

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError("config.json names no model_type, so mlx-lm cannot build the model")
    limit = None if tensors is None else _MODULES_PER_TENSOR * tensors + _MODULES_AT_LEAST
    try:
        model_class, args_class = _get_classes(config=config)
        with _modules_at_most(limit):
            model = model_class(args_class.from_dict(config))
    except _TooManyModules:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of mlx-lm's constructors means the same to the user
        raise ValueError(f"mlx-lm cannot build a {model_type} model from config.json ({type(e).__name__}: {e}); "
                         "is it an mlx-lm model, and is mlx-lm up to date?") from e
    # Random initial values become broadcast zeros, never evaluated: the model holds no weight memory.
    model.update(tree_map(lambda a: mx.broadcast_to(mx.zeros((), dtype=a.dtype), a.shape), model.parameters()))
    return model


def decoder_layer(path: str) -> int | None:
    """The decoder layer a module path belongs to: its first list index (model.layers.3.mlp, transformer.h.3)."""
    match = _LAYER.search(path)
    return int(match.group(1)) if match else None


def set_module(model, path: str, module) -> None:
    """Put `module` at `path` (dots and list indices, as named_modules writes it) inside `model`."""
    parent_path, _, name = path.rpartition(".")
    parent = model
    for part in parent_path.split(".") if parent_path else []:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    if isinstance(parent, list):
        parent[int(name)] = module
    else:
        setattr(parent, name, module)


def build_in_child_processes(on: bool = True) -> None:
    """From now on, this process builds models in a child process: no MLX memory, no GPU device here."""
    global _IN_CHILD
    _IN_CHILD = on


def switch_layers(config: dict, tensors: int | None = None) -> list[SwitchLayer]:
    """The routed-expert layers that mlx-lm's model for this config runs in a forward, in layer order.

    Switch layers the forward never calls (multi-token-prediction heads) are left out: they are ordinary
    weights to mlx-lm's generation. tensors: how many tensors the model's files hold, which bounds the modules
    the build may make (None: a config of our own, unbounded). Raises ValueError when mlx-lm cannot build or run
    the model."""
    # Building imports mlx-lm: 1.7 s of every daemon start on a 2-core Linux VM, and of every process that
    # only copies records (a client, `moe-l2 verify`). The answer is kept, so a later open of the same model,
    # in any process, skips it.
    kept = kept_answer(config)
    if kept is not None:
        try:
            return _parse(kept.read_text())
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass  # not kept yet, or unreadable: build it
    built = _built_in_child(config, tensors) if _IN_CHILD else None
    if built is None:
        built = json.dumps([layer.__dict__ for layer in _switch_layers_here(config, tensors)])
    layers = _parse(built)
    if kept is not None:
        _keep(kept, built)
    return layers


def _built_in_child(config: dict, tensors: int | None) -> str | None:
    """The child process' answer (JSON), or None where no child can be started."""
    # -P: a source checkout in the working directory must not shadow the installed package.
    try:
        done = subprocess.run([sys.executable, "-P", "-c", _CHILD], capture_output=True, text=True, timeout=600,
                              input=json.dumps({"config": config, "tensors": tensors}))
    except OSError as exc:  # e.g. a service user that may not execute this interpreter's path again
        log.warning("cannot start a child process to build the model (%s); building it in this process, "
                    "which asks MLX's allocator for a few bytes", exc)
        return None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(last.split(": ", 1)[1] if last.startswith("ValueError: ") else
                         f"building the model in a child process failed: {last}")
    return done.stdout


def kept_answer(config: dict) -> Path | None:
    """Where the child's answer for this config is kept: under the user's cache dir, named by a hash of the
    config, the MLX and mlx-lm versions and this module's source, so that a change to any builds again. None
    where that cannot be told."""
    import platformdirs

    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    try:
        for dist in ("mlx", "mlx-lm"):
            digest.update(metadata.version(dist).encode())
        digest.update(Path(__file__).read_bytes())
    except (OSError, metadata.PackageNotFoundError):
        return None
    return Path(platformdirs.user_cache_dir("moe-l2")) / "switch-layers" / f"{digest.hexdigest()[:32]}.json"


def _parse(text: str) -> list[SwitchLayer]:
    return [SwitchLayer(**{**d, "projections": tuple(d["projections"]), "rows": tuple(d["rows"])})
            for d in json.loads(text)]


def _keep(path: Path, text: str) -> None:
    """Write atomically, so that a daemon starting meanwhile reads the whole answer or none; a cache dir that
    cannot be written (a service user without a home) only costs the next start the child again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with AtomicFile(path, 0o600) as f:
            f.write(text.encode())
    except OSError as exc:
        log.info("cannot keep the model's switch layers in %s (%s): the next start builds them again", path, exc)


def _switch_layers_here(config: dict, tensors: int | None = None) -> list[SwitchLayer]:
    import mlx.core as mx
    import mlx.nn as nn

    _mlx_lm_utils()  # first: any import of mlx_lm imports it
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

    model = _build(config, tensors)
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    top_k: dict[str, int] = {}

    class Probe(nn.Module):
        def __init__(self, path: str, inner):
            super().__init__()
            self.inner = inner
            object.__setattr__(self, "_path", path)

        def __call__(self, x, indices):
            top_k[self._path] = indices.shape[-1]
            return self.inner(x, indices)

    for path, module in found:
        set_module(model, path, Probe(path, module))
    try:
        # As mlx-lm's generation calls it; lazy: builds the graph, evaluates nothing.
        model(mx.zeros((1, 1), dtype=mx.int32), cache=make_prompt_cache(model))
    except Exception as e:  # noqa: BLE001 - the architecture's own forward failed on a shape-only model
        raise ValueError(f"mlx-lm's {config.get('model_type')} model does not run one token shape-only "
                         f"({type(e).__name__}: {e})") from e

    out = []
    for path, module in found:
        if path not in top_k:
            continue
        projections = tuple(name for name, child in module.children().items()
                            if isinstance(child, (SwitchLinear, QuantizedSwitchLinear)))
        counts = {getattr(module, name).weight.shape[0] for name in projections}
        layer = decoder_layer(path)
        if len(counts) != 1 or layer is None:
            raise ValueError(f"mlx-lm's {config.get('model_type')} switch layer {path} has "
                             f"{'no decoder layer number' if layer is None else f'expert counts {sorted(counts)}'}")
        rows = tuple(getattr(module, name).weight.shape[1] for name in projections)
        out.append(SwitchLayer(path, layer, projections, counts.pop(), top_k[path], rows))
    return sorted(out, key=lambda s: (s.layer, s.path))
