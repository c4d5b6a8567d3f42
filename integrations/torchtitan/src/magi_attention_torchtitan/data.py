"""Offline training data: synthetic text documents, packed like torchtitan's text datasets, and a tiny tokenizer.

Each document is a run of letters that steps through the alphabet with a stride of 1 to 3 from a random
letter ("dgjmp..."), so a model can learn it (the stride is visible after two letters) and the loss falls
within a few dozen steps. Documents are tokenized with BOS and EOS and packed exactly as torchtitan's
`HuggingFaceTextDataset` packs: inputs and labels shifted inside each document (no label crosses a document
end), positions restarting at 0 at each document, a document cut at a sample's end going on, with positions
from 0 again, in the next sample.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

__all__ = [
    "SyntheticDocumentsDataLoader",
    "SyntheticDocumentsDataset",
    "synthetic_document",
    "tokenizer_path",
]


def tokenizer_path() -> str:
    """Folder of the tokenizer shipped with this package, for `Trainer.Config.hf_assets_path`.

    A character-level Hugging Face tokenizer (`tokenizer.json`, `tokenizer_config.json`): 42 tokens, BOS 0,
    EOS 1, lower-case letters, digits, space, '.' and ','.
    """
    return str(files("magi_attention_torchtitan") / "assets" / "tokenizer")


def synthetic_document(generator: torch.Generator, min_len: int, max_len: int) -> str:
    """One document: `min_len`..`max_len` letters stepping through the alphabet from a random letter."""
    length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
    start = int(torch.randint(0, 26, (1,), generator=generator))
    stride = int(torch.randint(1, 4, (1,), generator=generator))
    return "".join(string.ascii_lowercase[(start + stride * i) % 26] for i in range(length))


class SyntheticDocumentsDataset(IterableDataset, Stateful):
    """Endless packed samples of synthetic documents, each `({"input", "positions"}, labels)` of `seq_len`.

    Args:
        tokenizer: encodes the documents (with BOS and EOS).
        seq_len: tokens per sample.
        seed: with `dp_rank`, fixes the documents (the same on the cp ranks of one data-parallel replica).
        dp_rank: this replica's index; replicas read different documents.
        min_doc_len, max_doc_len: letters per document.
    """

    def __init__(
        self,
        tokenizer: BaseTokenizer,
        *,
        seq_len: int,
        seed: int,
        dp_rank: int,
        min_doc_len: int,
        max_doc_len: int,
    ) -> None:
        if not 1 <= min_doc_len <= max_doc_len:
            raise ValueError(f"need 1 <= min_doc_len <= max_doc_len, got {min_doc_len}, {max_doc_len}")
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self._seed = seed + 1_000_003 * dp_rank
        self._min_len, self._max_len = min_doc_len, max_doc_len
        self._doc_index = 0
        self._inputs: list[int] = []
        self._labels: list[int] = []
        self._positions: list[int] = []

    def _next_document(self) -> list[int]:
        generator = torch.Generator().manual_seed(self._seed + self._doc_index)
        self._doc_index += 1
        text = synthetic_document(generator, self._min_len, self._max_len)
        return self._tokenizer.encode(text, add_bos=True, add_eos=True)

    def __iter__(self):
        while True:
            tokens = self._next_document()
            self._inputs.extend(tokens[:-1])
            self._labels.extend(tokens[1:])
            self._positions.extend(range(len(tokens) - 1))
            while len(self._inputs) >= self.seq_len:
                positions = self._positions[: self.seq_len]
                # a document cut by the previous sample goes on here from position 0
                offset = positions[0]
                cut = next((i for i, p in enumerate(positions) if p == 0), len(positions))
                positions = [p - offset for p in positions[:cut]] + positions[cut:]
                sample = (
                    {
                        "input": torch.tensor(self._inputs[: self.seq_len], dtype=torch.long),
                        "positions": torch.tensor(positions, dtype=torch.long),
                    },
                    torch.tensor(self._labels[: self.seq_len], dtype=torch.long),
                )
                del (
                    self._inputs[: self.seq_len],
                    self._labels[: self.seq_len],
                    self._positions[: self.seq_len],
                )
                yield sample

    def state_dict(self) -> dict[str, Any]:
        return {
            "doc_index": self._doc_index,
            "inputs": list(self._inputs),
            "labels": list(self._labels),
            "positions": list(self._positions),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._doc_index = state_dict["doc_index"]
        self._inputs = list(state_dict["inputs"])
        self._labels = list(state_dict["labels"])
        self._positions = list(state_dict["positions"])


class SyntheticDocumentsDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader of `SyntheticDocumentsDataset` (no download, no files): batches
    `({"input": [B, L], "positions": [B, L]}, labels [B, L])` like torchtitan's text dataloaders."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "synthetic_documents"
        """Name shown in logs (the data is always the synthetic documents)."""
        seed: int = 0
        """Seed of the documents."""
        min_doc_len: int = 8
        """Fewest letters in a document."""
        max_doc_len: int = 96
        """Most letters in a document."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
    ) -> None:
        dataset = SyntheticDocumentsDataset(
            tokenizer,
            seq_len=seq_len,
            seed=config.seed,
            dp_rank=dp_rank,
            min_doc_len=config.min_doc_len,
            max_doc_len=config.max_doc_len,
        )
        super().__init__(
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
            batch_size=local_batch_size,
        )
