"""A stage's backward in two parts: the input gradient now, the weight gradients later.

Zero-bubble schedules (Qi et al., ICLR 2024) run a micro-batch's backward as I, which computes only
the gradient the previous stage waits for, and W, which computes the weight gradients whenever the
device would otherwise sit idle. Autograd computes both in one pass; :func:`input_gradients` and
:func:`weight_gradients` split it without repeating work:

* I runs ``torch.autograd.grad`` from the stage's outputs to its inputs alone. Autograd then skips
  every branch that leads only to weights (the weight gradient of a matmul is not computed when
  only its input's is asked for), and keeps the graph (``retain_graph``) for W. Before it runs, the
  graph is searched for the nodes where a weight's branch leaves the path to the inputs (a
  ``Linear``'s matmul node, say): a hook on each keeps the gradient that flows into it.
* W starts autograd again at those nodes, from the kept gradients, towards the weights only: each
  node recomputes just its weight-side outputs. Weights whose branches share such a node are done in
  one call (so nothing is counted twice); the others one group at a time, so no group's call runs
  through another group's nodes.

What is held from I to W: every tensor the forward saved (the graph is kept whole, as
``retain_graph`` keeps it, and freed when W is done with it), and the kept gradients (one per
weight-branching node). On a stage whose inputs need no gradient (the first), I has nothing to
compute and W is the whole backward.
The search is a walk over the micro-batch's autograd graph in Python, a few microseconds per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class PendingWeights:
    """What W needs of one micro-batch: per group of weights, the nodes it starts from and the
    gradients I saw flowing into them."""

    groups: list[tuple[list[torch.Tensor], list[Node]]]  # (weights, their branching nodes)
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    # no input needs a gradient (the first stage): I does nothing, W is the whole backward from these
    whole: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None
    edges: "WeightEdges | None" = None  # the weights' accumulators


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots``, the nodes that feed it a gradient (autograd's edges
    reversed)."""
    parents: dict[Node, list[Node]] = {}
    seen, stack = set(roots), list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _upstream(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node] | frozenset = frozenset()
              ) -> tuple[set[Node], set[Node]]:
    """Nodes from ``starts`` towards the roots, not walking past ``stop``; and the ``stop`` nodes met."""
    seen, met, stack = set(starts), set(), list(starts)
    while stack:
        node = stack.pop()
        for parent in parents.get(node, ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen, met


def _node(tensor: torch.Tensor) -> Node | None:
    return get_gradient_edge(tensor).node if tensor.requires_grad else None


class WeightEdges:
    """A stage's weights with their gradient accumulators, found once. Holding an accumulator keeps it
    the node every micro-batch's graph ends in, so it is not looked up (a view made) per call."""

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self.weights = [w for w in weights if w.requires_grad]
        self.edges = {id(w): get_gradient_edge(w) for w in self.weights}

    def edge(self, weight: torch.Tensor) -> GradientEdge:
        return self.edges[id(weight)]


def plan_weights(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 weights: Sequence[torch.Tensor] | WeightEdges) -> PendingWeights:
    """Find where each weight's branch meets the path from ``roots`` to ``inputs``; group the weights
    that meet it at a common node."""
    root_nodes = [n for n in (_node(r) for r in roots) if n is not None]
    parents = _parents(root_nodes)
    input_nodes = [n for n in (_node(x) for x in inputs) if n is not None]
    on_input_path, _ = _upstream(input_nodes, parents)
    known = weights if isinstance(weights, WeightEdges) else WeightEdges(weights)
    groups: list[tuple[list[torch.Tensor], set[Node]]] = []
    for weight in known.weights:
        node = known.edge(weight).node
        if node is None or node not in parents:
            continue  # not used by this micro-batch's graph
        _, meets = _upstream([node], parents, on_input_path)
        if node in on_input_path or not meets:
            meets = {node}  # the weight hangs off the path itself, or no input needs a gradient
        merged = [g for g in groups if g[1] & meets]
        groups = [g for g in groups if not g[1] & meets]
        groups.append(([w for g in merged for w in g[0]] + [weight], set().union(meets, *(g[1] for g in merged))))
    return PendingWeights([(ws, sorted(nodes, key=id)) for ws, nodes in groups], edges=known)


def input_gradients(roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor] | None,
                    inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor] | WeightEdges
                    ) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """I: the gradients of ``inputs`` (None where unused), and what W will need.

    ``roots`` are the stage's outputs (with ``root_grads``) or its loss (``root_grads`` None)."""
    if not any(x.requires_grad for x in inputs):
        return [None] * len(inputs), PendingWeights([], whole=(list(roots), root_grads))
    pending = plan_weights(roots, inputs, weights)
    starts = {node for _, nodes in pending.groups for node in nodes if not _is_leaf_accumulator(node)}

    def keeper(node: Node):
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            pending.kept[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keeper(node)) for node in starts]
    try:
        wanted = [x for x in inputs if x.requires_grad]
        targets = wanted + [w for ws, nodes in pending.groups for w in ws
                            if any(_is_leaf_accumulator(n) for n in nodes)]
        grads = torch.autograd.grad(roots, targets, root_grads, retain_graph=True, allow_unused=True) \
            if targets else ()
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), grads[:len(wanted)]))
    for weight, grad in zip(targets[len(wanted):], grads[len(wanted):]):  # weights on the roots' path itself
        _accumulate(weight, grad)
    return [by_input.get(id(x)) for x in inputs], pending


def _is_leaf_accumulator(node: Node) -> bool:
    """A weight's own accumulator node: its gradient is final once I has run through it."""
    return not node.next_functions and type(node).__name__ == "AccumulateGrad"


def weight_gradients(pending: PendingWeights) -> None:
    """W: add each weight's gradient to its ``.grad``, starting from the gradients I kept."""
    if pending.whole is not None:
        roots, root_grads = pending.whole
        pending.whole = None
        torch.autograd.backward(roots, root_grads)
        return
    for weights, nodes in pending.groups:
        starts = [n for n in nodes if n in pending.kept]
        edges, grads = [], []
        for node in starts:
            for index, grad in enumerate(pending.kept[node]):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if not edges:
            continue
        # a node reached from another start of this group gets the gradient I saw, not a second sum
        handles = [node.register_prehook(lambda _grads, kept=pending.kept[node]: kept) for node in starts]
        try:
            # the graph is kept until the micro-batch lets go of it (a node below two groups' starts)
            found = torch.autograd.grad(edges, [pending.edges.edge(w) for w in weights], grads, retain_graph=True,
                                        allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for weight, grad in zip(weights, found):
            _accumulate(weight, grad)
    pending.kept.clear()
    pending.groups.clear()
    pending.edges = None


def _accumulate(weight: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad
