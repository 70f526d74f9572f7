"""torchx component: a chatpipe stage for ``torchx run``, the same AppDef ``python -m chatpipe.launch`` builds.

    torchx run -- --stage pretrain                                # component and scheduler from .torchxconfig
    torchx run chatpipe/components.py:app --stage pretrain --nproc_per_node 2 -- --max_steps=20
    torchx run -s kubernetes --dryrun -- --stage pretrain --scheduler kubernetes

Topology, image and resources come from the ``launch`` section of params.yaml (profile included),
overridden by the arguments below; arguments after ``--`` go to the stage (``--key=value``).

torchx 0.7 reads a component's signature with its own linter (``Optional[...]``, ``List[...]``
and plain types only: it crashes on ``X | None``) and converts command-line strings with the
annotations it finds at run time, so this module keeps real (not postponed) annotations: no
``from __future__ import annotations`` here.
"""

from typing import Optional

import torchx.specs as specs

from chatpipe.launch import build_app
from chatpipe.settings import LaunchSettings, load_section, validate_all


# Optional[...], not `X | None`: torchx 0.7's component linter crashes on the latter.
def app(
    *stage_args: str,
    stage: str,
    nnodes: Optional[int] = None,  # noqa: UP045
    nproc_per_node: Optional[int] = None,  # noqa: UP045
    scheduler: Optional[str] = None,  # noqa: UP045
    image: Optional[str] = None,  # noqa: UP045
) -> specs.AppDef:
    """A chatpipe stage (``stages.<stage>``) as a torchx app.

    Args:
        stage_args: overrides passed to the stage, e.g. ``--max_steps=20``
        stage: data | tokenizer | pretrain | midtrain | sft | rl | eval | report
        nnodes: nodes (default: params.yaml launch.nnodes)
        nproc_per_node: worker processes per node (default: launch.nproc_per_node)
        scheduler: the scheduler given to ``torchx run -s`` when it is not params.yaml's
            (locally, workers get this Python's bin dir as PATH; remote ones keep the image's)
        image: container image for kubernetes (default: launch.image)
    """
    validate_all()  # a bad value anywhere stops here, naming the key, before anything launches
    overrides = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "scheduler": scheduler, "image": image}
    launch = load_section(LaunchSettings, {k: v for k, v in overrides.items() if v is not None})
    return build_app(stage, launch, list(stage_args))
