"""The chat model as an MLflow pyfunc model: ``mlflow models serve`` and ``mlflow.pyfunc.load_model`` work on it.

    import mlflow
    model = mlflow.pyfunc.load_model("models:/chatpipe@latest")
    model.predict(["What is 12 + 7?"], params={"max_tokens": 32})      # -> ["12 + 7 = [calc: 12+7 = 19] ..."]

    mlflow models serve -m models:/chatpipe@champion --env-manager local -p 5001
    curl -d '{"inputs": ["hi"], "params": {"temperature": 0.6}}' -H 'Content-Type: application/json' \\
        localhost:5001/invocations                                       # -> {"predictions": ["..."]}

:func:`log_chat_model` (used by the report stage) logs a model directory written by
:func:`chatpipe.model.files.save_model_dir` with its tokenizer beside it, so the logged
model is self-contained: ``artifacts/model/{model.pt, meta.json, tokenizer/}`` plus the chatpipe
package as code. Each input is one user message; each prediction is the assistant's reply, with
calculator calls shown inline as ``[calc: 12+7 = 19]`` as in ``chatpipe chat``.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc

# sampling defaults a request can override through ``params``: greedy, so a served model is deterministic
DEFAULT_PARAMS: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "max_tokens": 64, "seed": 42}
PACKAGE = Path(__file__).resolve().parents[1]  # the chatpipe package, shipped with the model as code


def signature():
    """Input: a string per prompt; output: a string per reply; params: the sampling settings.

    The columns are unnamed so that a plain list of strings is a valid input (``{"inputs": [...]}``).
    """
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema(
        [ParamSpec(k, "double" if isinstance(v, float) else "long", v) for k, v in DEFAULT_PARAMS.items()]
    )
    return ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]), params=params)


def _prompts(model_input: Any) -> list[str]:
    """Prompts from what pyfunc passes: a DataFrame (its ``prompt`` or first column), a list, a dict, a string."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # pandas DataFrame
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(v) for v in model_input[column].tolist()]
    if isinstance(model_input, dict):
        value = model_input.get("prompt", next(iter(model_input.values()), []))
        return [value] if isinstance(value, str) else [str(v) for v in value]
    return [str(v) for v in model_input]


class ChatModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: loads the GPT and tokenizer from the model's ``model`` artifact, replies greedily by default."""

    def load_context(self, context) -> None:
        """Load weights and tokenizer (from ``artifacts/model``) onto the CPU or the first GPU."""
        from chatpipe.inference.engine import Engine
        from chatpipe.model.loading import load_chat_model

        model_dir = Path(context.artifacts["model"])
        loaded = load_chat_model(str(model_dir), tokenizer_dir=model_dir / "tokenizer", device="auto")
        self.engine = Engine(loaded.model, loaded.tokenizer)

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        """One reply per prompt (each a new single-turn conversation)."""
        from chatpipe.serve.chat import show_stream

        p = checked_params(params)
        replies = []
        for prompt in _prompts(model_input):
            ids = self.engine.tokenizer.render_for_completion({"messages": [{"role": "user", "content": prompt}]})
            pieces = self.engine.stream(
                ids,
                max_tokens=int(p["max_tokens"]),
                temperature=float(p["temperature"]),
                top_k=int(p["top_k"]) or None,
                seed=int(p["seed"]),
            )
            out = io.StringIO()
            show_stream(pieces, out)  # renders calculator calls the way `chatpipe chat` shows them
            replies.append(out.getvalue().removesuffix("\n"))
        return replies


def checked_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling params over the defaults; a value out of range is MLflow's 400 naming the param."""
    import math
    import numbers

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    p = {**DEFAULT_PARAMS, **(params or {})}
    bounds = {"temperature": (0.0, 5.0), "top_k": (0, 2**31), "max_tokens": (1, 8192), "seed": (0, 2**63 - 1)}
    for name, (lo, hi) in bounds.items():
        value = p[name]
        # numbers.Real: MLflow may hand over numpy scalars
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            ok = False
        else:
            ok = lo <= value <= hi and (name == "temperature" or float(value).is_integer())
        if not ok:
            raise MlflowException(
                f"params.{name} = {value!r}: must be a number in {lo}..{hi}", error_code=INVALID_PARAMETER_VALUE
            )
    return p


def package_model_dir(model_dir: Path, tokenizer_dir: Path, dest: Path) -> Path:
    """``dest/model``: the model files with ``tokenizer/`` beside them (what gets logged). A model dir
    carries its own tokenizer (checked by its manifest); ``tokenizer_dir`` is for older ones only."""
    out = dest / "model"
    shutil.copytree(model_dir, out)
    if not (out / "tokenizer").is_dir():
        shutil.copytree(tokenizer_dir, out / "tokenizer")
    return out


def log_chat_model(model_dir: Path, tokenizer_dir: Path, name: str = "model", **kw: Any):
    """Log ``model_dir`` (+ tokenizer) as a pyfunc model in the active run; returns MLflow's ModelInfo.

    Extra keyword arguments go to :func:`mlflow.pyfunc.log_model` (e.g. ``registered_model_name``).
    """
    with tempfile.TemporaryDirectory(prefix="chatpipe-pyfunc-") as tmp:
        packaged = package_model_dir(Path(model_dir), Path(tokenizer_dir), Path(tmp))
        return mlflow.pyfunc.log_model(
            name=name,
            python_model=ChatModel(),
            artifacts={"model": str(packaged)},
            code_paths=[str(PACKAGE)],
            signature=signature(),
            input_example=["What is 12 + 7?"],
            pip_requirements=_requirements(),
            **kw,
        )


def _requirements() -> list[str]:
    """The packages the model needs at serving time, pinned to the versions installed here."""
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg)}" for pkg in ("mlflow", "torch", "tiktoken", "pydantic-settings", "pyyaml")]
