"""Which MoE families of the installed transformers gspo-lab can replay routing for, and why not the others.

    python scripts/moe_families.py            # a markdown table: family, router class(es), supported or the reason

A family is a mixture of experts when its modeling file defines an experts or sparse-MoE class; it is
supported when one of its classes has an adapter in gspo_lab.routing.adapters.ADAPTERS (tested in
tests/routing/test_replay.py on a tiny config of that family). For the others the reason is what is missing:
an adapter for the router class it names, or, where the family has no router module, a hook on its MoE block.
Reads the modeling files' source only (nothing is imported or built).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import transformers

from gspo_lab.routing.adapters import ADAPTERS

MOE_CLASS = re.compile(r"(Experts|SparseMoe|MoE|Moe)\w*$")
ROUTER_CLASS = re.compile(r"(Router|TopKGating|Gate)$")
NOT_ROUTER = re.compile(r"Forget|Residual|Norm")


def class_sources(path: Path) -> dict[str, str]:
    """Each top-level class of a modeling file -> its source text."""
    text = path.read_text()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^class (\w+)\(", text, re.MULTILINE)]
    ends = [start for start, _ in starts[1:]] + [len(text)]
    return {name: text[start:end] for (start, name), end in zip(starts, ends)}


def forward_of(source: str) -> str:
    """A class's forward method, as written (comparable across families: it names no classes)."""
    match = re.search(r"    def forward\(.*?(?=\n    def |\Z)", source, re.DOTALL)
    return match.group(0).strip() if match else ""


def families() -> list[tuple[str, list[str], list[str], dict[str, str]]]:
    """(model_type folder, router classes, MoE classes, router forwards) for every MoE modeling file."""
    found = []
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        sources = class_sources(path)
        moe = [c for c in sources if MOE_CLASS.search(c) and not c.endswith(("PreTrainedModel", "Model", "Output"))]
        routers = [c for c in sources if ROUTER_CLASS.search(c) and not NOT_ROUTER.search(c)]
        if moe:
            found.append((path.parent.name, routers, moe, {c: forward_of(sources[c]) for c in routers}))
    return found


def row(family: str, routers: list[str], moe: list[str], forwards: dict[str, str], adapted: dict[str, str]) -> str:
    supported = [c for c in routers + moe if c in ADAPTERS]
    twins = sorted({adapted[f] for f in forwards.values() if f in adapted} - set(supported))
    if supported:
        status = "supported (tested)"
    elif routers:
        status = f"not supported: no adapter for {', '.join(routers)}"
        if twins:
            status += f" (its forward is {', '.join(twins)}'s, word for word: an adapter entry and a test away)"
    else:
        status = f"not supported: selection happens inside {moe[0]} (no router module to hook)"
    return f"| {family} | {', '.join(supported or routers) or '-'} | {status} |"


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(f"MoE families in transformers {transformers.__version__}\n")
    print("| family | router class | routing replay |\n| --- | --- | --- |")
    found = families()
    adapted = {f: c for _, _, _, forwards in found for c, f in forwards.items() if c in ADAPTERS and f}
    for family, routers, moe, forwards in found:
        print(row(family, routers, moe, forwards, adapted))


if __name__ == "__main__":
    main()
