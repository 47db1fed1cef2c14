"""A `Guesser` over a `Proposer`: the guesses it holds for each sequence, proposed after each
sample and handed out at the next step."""

from __future__ import annotations

from tidal.spec.prediction import PredictionLookup
from tidal.spec.proposer import Proposer
from tidal.spec.tree import GuessTree


class Speculator:
    """Guesses for the sequences the runner holds: proposed after each sample (the count
    goes to the scheduler, which plans k from it), handed out at the next step (proposed
    afresh if the sequence grew since). Keeps no KV."""

    def __init__(self, proposer: Proposer, max_guesses: int) -> None:
        self.proposer = proposer
        self.max_guesses = max_guesses
        self.predictions = PredictionLookup()  # requests' predicted outputs, asked first
        self._held: dict[str, tuple[int, GuessTree]] = {}  # id -> (output length, guesses)

    def block_bytes(self, block_size: int) -> int:
        return 0

    def allocate(self, num_blocks: int, block_size: int) -> None:
        pass

    def copy_blocks(self, src, dst) -> None:
        pass

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        self._held.pop(seq_id, None)
        self.proposer.forget(seq_id, output, finished)
        self.predictions.forget(seq_id)

    def propose(self, seq_id: str, prompt: list[int], output: list[int],
                prediction: list[int] | None = None) -> int:
        guesses = self.proposer.propose(seq_id, prompt, output, self.max_guesses)
        if prediction:  # the proposer still saw the tokens: its index stays current
            guesses = (self.predictions.propose(seq_id, prediction, output, self.max_guesses)
                       or guesses)
        self._held[seq_id] = (len(output), guesses)
        return len(guesses)

    def guesses(self, scheduled: list, seqs: dict, batches,
                wanted: dict[str, int]) -> dict[str, GuessTree]:
        return {rid: self.guess(rid, seqs[rid].prompt, seqs[rid].output, k,
                                seqs[rid].params.prediction)
                for rid, k in wanted.items()}

    def guess(self, seq_id: str, prompt: list[int], output: list[int], k: int,
              prediction: list[int] | None = None) -> GuessTree:
        """The best k guesses (or fewer) to verify after `output` now."""
        held = self._held.get(seq_id)
        if held is None or held[0] != len(output):  # grown since: async, or none asked for
            self.propose(seq_id, prompt, output, prediction)
            held = self._held[seq_id]
        return held[1].take(k)
