"""Every equation of a jaxpr, those of the jaxprs nested in it (loops, custom VJPs, checkpoints, Pallas
kernel bodies) included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.extend


def all_equations(jaxpr: Any) -> Iterator[Any]:  # a Jaxpr or ClosedJaxpr -> its JaxprEqns, depth first
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_equations(inner)
