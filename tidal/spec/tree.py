"""A speculation tree: candidate continuations of a sequence that share their prefixes,
verified together in one forward pass.

Node i guesses `tokens[i]` after its parent (`parents[i]`; -1: the root, the sequence's
last known token), so a path from the root is one candidate continuation. A proposer lists
its nodes best first (the likeliest continuation's first, a parent always before its
children); `take(k)` keeps the k best and lays them out depth first, each node's children
in that order, so that the main path (every node's best child) comes first and is where a
chain of guesses would be.

A verification runs the root and every node as one row each: node i at position
root + depth(i), in KV slot root + 1 + i, attending to the context, the root and its own
ancestors (`visible`). The model's sample at a row is drawn after that row's path, so
walking from the root to the child whose token is the sample (siblings' tokens differ: at
most one matches) emits exactly the tokens that one row at a time would have: lossless,
greedy or sampled. For one path whose guesses are single tokens, not distributions, this is
the rejection sampler of Leviathan et al. exactly: guess g is kept with probability p(g),
and a rejected position emits a sample of p with g removed, renormalised; greedy rows keep
g iff it is the argmax. A tree's siblings extend it: the sample is kept wherever some
sibling guessed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A tree row sees the root and its ancestors through a 64-bit mask over the 1 + nodes slots
# from the root on (the attention kernels' tree mask).
MAX_TREE_NODES = 63


@dataclass
class GuessTree:
    """Guessed tokens and each one's parent node (-1: the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int]) -> "GuessTree":
        """One path: each guess follows the one before it."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """A node guessing `token` after node `parent`; its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's distance from the root (a child of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def main_path(self) -> list[int]:
        """The tokens of the leading path (a laid-out tree's first nodes)."""
        out = []
        for i, p in enumerate(self.parents):
            if p != i - 1:
                break
            out.append(self.tokens[i])
        return out

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (none for the root, -1)."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def take(self, k: int) -> "GuessTree":
        """The k best nodes (a best-first list's first k: each one's parent is among them),
        laid out depth first with the main path first."""
        k = min(k, len(self.tokens), MAX_TREE_NODES)
        children: dict[int, list[int]] = {}
        for i in range(k):
            children.setdefault(self.parents[i], []).append(i)
        out, stack = GuessTree(), [(-1, c) for c in reversed(children.get(-1, []))]
        while stack:
            parent, old = stack.pop()
            new = out.add(parent, self.tokens[old])
            stack += [(new, c) for c in reversed(children.get(old, []))]
        return out

    def visible(self) -> list[int]:
        """Per node, the bits over slots root + 0 .. root + len that its row attends to:
        the root (bit 0), its ancestors and itself (bit 1 + node)."""
        bits: list[int] = []
        for i, p in enumerate(self.parents):
            bits.append((1 if p < 0 else bits[p]) | 1 << (1 + i))
        return bits

    def accept(self, samples: list[int]) -> tuple[list[int], list[int]]:
        """The tokens a verification emits and the nodes accepted on the way, from the
        model's sample at each row (row 0: the root, row 1 + i: node i): from the root,
        each sample that some child guessed moves there; the first that none did ends it
        (after a leaf, the sample is a bonus token)."""
        kids: dict[int, dict[int, int]] = {}
        for i, (p, t) in enumerate(zip(self.parents, self.tokens)):
            kids.setdefault(p, {}).setdefault(t, i)
        emitted, nodes, node = [], [], -1
        while True:
            token = samples[node + 1]
            emitted.append(token)
            node = kids.get(node, {}).get(token, -1)
            if node < 0:
                return emitted, nodes
            nodes.append(node)
