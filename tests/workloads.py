"""Workloads nobody here wrote: a small image classifier on synthetic digits, read sample by sample.

Used through import paths (``workloads:digits``, ``workloads:cnn``) exactly as a user's own
module would be.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from coretrain.run import Datasets

CLASSES = 10


class Digits(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """8×8 one-channel images: one noisy prototype per class; ``delay`` seconds of "I/O" per sample;
    ``augment``: fresh noise on every read, drawn from the global torch generator (as torchvision's
    random transforms draw)."""

    def __init__(self, count: int, seed: int, delay: float = 0.0, augment: bool = False) -> None:
        prototypes = torch.randn(CLASSES, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (count,), generator=g)
        self.images = prototypes[self.labels] + 1.2 * torch.randn(count, 1, 8, 8, generator=g)
        self.delay, self.augment = delay, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        image = self.images[index]
        return (image + 0.3 * torch.randn(image.shape) if self.augment else image), self.labels[index]


def digits(
    context: Any = None,
    train: int = 1200,
    valid: int = 359,
    test: int = 201,
    delay: float = 0.0,
    augment: bool = False,
) -> Datasets:
    return Datasets(train=Digits(train, 1, delay, augment), valid=Digits(valid, 2, delay), test=Digits(test, 3, delay))


def digits_train_only(context: Any = None) -> Digits:
    """The training digits alone, as a provider that makes no validation split hands them over."""
    return Digits(1200, 1)


def as_dict(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A user collate_fn: a dict batch whose target is under 'labels'."""
    return {"pixels": torch.stack([s[0] for s in samples]), "labels": torch.stack([s[1] for s in samples])}


COLLATED: list[int] = []
"""Batch sizes :func:`counted_as_dict` collated, for a test to see it was used."""


def counted_as_dict(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    COLLATED.append(len(samples))
    return as_dict(samples)


class Buckets(torch.utils.data.Sampler[list[int]]):
    """A batch sampler that makes batches its own way (here: strided)."""

    def __init__(self, samples: int, batch_size: int) -> None:
        self.samples, self.batch_size = samples, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        stride = len(self)
        yield from (list(range(start, self.samples, stride)) for start in range(stride))

    def __len__(self) -> int:
        return self.samples // self.batch_size


class Batches(torch.utils.data.Dataset[Any]):
    """A dataset whose items are whole batches of another's samples."""

    def __init__(self, samples: Any, batch_size: int) -> None:
        self.samples, self.batch_size = samples, batch_size

    def __len__(self) -> int:
        return len(self.samples) // self.batch_size

    def __getitem__(self, index: int) -> Any:
        start = index * self.batch_size
        return torch.utils.data.default_collate([self.samples[i] for i in range(start, start + self.batch_size)])


def digit_loaders(context: Any = None, batch_size: int = 32, sampler: str = "", collate: bool = False) -> Any:
    """What a training script holds: DataLoaders (shuffled train, ordered valid), a sampler of its
    own and a collate_fn if asked."""
    data = digits()
    options: dict[str, Any] = {"batch_size": batch_size, "num_workers": 0}
    if collate:
        options["collate_fn"] = counted_as_dict
    if sampler == "weighted":
        options["sampler"] = torch.utils.data.WeightedRandomSampler(torch.ones(len(data.train)), len(data.train))
    elif sampler == "distributed":  # a DDP script's: shuffles and shards over ranks, as coretrain's order does
        options["sampler"] = torch.utils.data.DistributedSampler(data.train, num_replicas=2, rank=0)
    elif sampler == "buckets":  # batches made by a batch sampler of the script's (as by length)
        del options["batch_size"]
        options["batch_sampler"] = Buckets(len(data.train), batch_size)
    elif sampler == "unbatched":  # the dataset batches itself; the loader hands its items over
        options["batch_size"] = None
    else:
        options["shuffle"] = True
    batched = sampler == "unbatched"
    train = torch.utils.data.DataLoader(Batches(data.train, batch_size) if batched else data.train, **options)
    valid = torch.utils.data.DataLoader(data.valid, **{**options, "shuffle": False, "sampler": None})
    return train, valid


class CNN(torch.nn.Module):
    """Returns logits; the config's model.loss makes the loss. ``dropout`` before the classifier
    (no parameters of its own: the state dict is the same with or without)."""

    def __init__(self, width: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(dropout)
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(width, width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(width * 16, CLASSES),
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net[-1](self.dropout(self.net[:-1](pixels)))


class CNNWithAccuracy(CNN):
    """Returns its own loss and accuracy, as a dict."""

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(pixels)
        return {
            "loss": torch.nn.functional.cross_entropy(logits, labels),
            "accuracy": (logits.argmax(-1) == labels).float().mean(),
        }


class TupleCNN(CNN):
    """Returns a tuple, as nanoGPT's ``forward(idx, targets=None) -> (logits, loss)`` (the loss
    None without targets), or ``(loss, logits)`` as transformers' models with ``return_dict=False``."""

    def __init__(self, loss_first: bool = False) -> None:
        super().__init__()
        self.loss_first = loss_first

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[Any, ...]:  # type: ignore[override]
        logits = super().forward(pixels)
        if labels is None:
            return (logits,) if self.loss_first else (logits, None)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return (loss, logits) if self.loss_first else (logits, loss)


def tuple_cnn(loss_first: bool = False) -> torch.nn.Module:
    return TupleCNN(loss_first)


class NanoLM(torch.nn.Module):
    """nanoGPT's interface: ``forward(idx, targets=None) -> (logits, loss)``, its loss over
    ``targets.view(-1)`` (which needs contiguous targets), logits of the last position without
    targets; a bigram model in place of its blocks."""

    def __init__(self, vocab_size: int, n_embd: int = 32) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, n_embd)
        self.lm_head = torch.nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        x = self.wte(idx)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nano_lm(vocab_size: int) -> torch.nn.Module:
    return NanoLM(vocab_size)


def corpus_metrics(predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """A user's ``compute_metrics``: macro F1 over the split (no mean over batches gives it), and
    what shows it was handed every sample once, in order."""
    classes = predictions.argmax(-1)
    f1 = []
    for c in range(CLASSES):
        hits, predicted, actual = ((classes == c) & (labels == c)).sum(), (classes == c).sum(), (labels == c).sum()
        f1.append(float(2 * hits / (predicted + actual)) if predicted + actual else 1.0)
    ordered = (labels * torch.arange(len(labels))).sum()  # a 0-d tensor: numbers of any kind are taken
    return {
        "macro_f1": sum(f1) / CLASSES,
        "acc": (classes == labels).float().mean(),
        "samples": len(labels),
        "order": ordered,
    }


HANDED: list[Any] = []
"""What :func:`trainer_metrics` was handed, for the test to look at."""


def trainer_metrics(eval_pred: Any) -> dict[str, Any]:
    """A compute_metrics written for the Hugging Face Trainer, as its course writes one."""
    import numpy as np

    HANDED.append(eval_pred)
    logits, labels = eval_pred
    predictions = np.argmax(logits, axis=-1)
    return {"trainer_accuracy": (predictions == labels).mean(), "labels_seen": len(eval_pred.label_ids)}


def one_number(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """A compute_metrics that returns a number, not metrics by name."""
    return 0.5


def words_for_metrics(predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, str]:
    return {"f1": "high"}


def cnn(width: int = 16, dropout: float = 0.0) -> torch.nn.Module:
    return CNN(width, dropout)


def cnn_with_accuracy(width: int = 16) -> torch.nn.Module:
    return CNNWithAccuracy(width)


class DigitStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The digits as a stream read in order (a file, a socket): no length, no indexing."""

    def __init__(self, count: int, seed: int, delay: float = 0.0) -> None:
        self.data = Digits(count, seed, delay)

    def __iter__(self) -> Any:
        for i in range(len(self.data)):
            yield self.data[i]


class StatefulDigitStream(DigitStream):
    """A stream that knows its position and can be put back there (the state_dict protocol)."""

    def __init__(self, count: int, seed: int, delay: float = 0.0) -> None:
        super().__init__(count, seed, delay)
        self.position = 0

    def __iter__(self) -> Any:
        while self.position < len(self.data):
            self.position += 1
            yield self.data[self.position - 1]
        self.position = 0  # the next pass starts over

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class LaggingDigitStream(StatefulDigitStream):
    """A stream that counts an item once its ``yield`` has returned: its state is one item behind
    what it has handed out (a resume from it reads that item again)."""

    def __iter__(self) -> Any:
        while self.position < len(self.data):
            yield self.data[self.position]
            self.position += 1
        self.position = 0


def digit_stream(context: Any = None, stateful: bool | str = False, delay: float = 0.0) -> Datasets:
    """The digits as streams: ``stateful`` true (or ``"lagging"``: a state one item behind)."""
    kind = LaggingDigitStream if stateful == "lagging" else StatefulDigitStream if stateful else DigitStream
    return Datasets(train=kind(1200, 1, delay), valid=kind(359, 2, delay))


def hf_digits(context: Any = None, target: str = "labels") -> Datasets:
    """The digits as Hugging Face datasets (built in memory, as load_dataset would from local
    files), the class in the column ``target``."""
    import datasets

    def table(split: Digits) -> Any:
        return datasets.Dataset.from_dict({"pixels": split.images.numpy(), target: split.labels.numpy()})

    return Datasets(train=table(Digits(1200, 1)), valid=table(Digits(359, 2)))


def hf_digit_stream(context: Any = None, target: str = "label") -> Datasets:
    """The training digits as a Hugging Face stream (``load_dataset(..., streaming=True)`` gives
    one): python rows, the class in ``target``."""
    data = hf_digits(context, target)
    return Datasets(train=data.train.to_iterable_dataset(num_shards=2), valid=data.valid)


class ChattyCNN(CNN):
    """Warns on every forward, as a library deprecation often does."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        import warnings

        warnings.warn("ChattyCNN: this argument is deprecated", UserWarning, stacklevel=2)
        return super().forward(pixels)


def chatty_cnn() -> torch.nn.Module:
    return ChattyCNN()


def digits_named_valid(context: Any = None, names: tuple[str, ...] = ("clean", "noisy")) -> Datasets:
    """Two validation sets by name (the second drawn with another seed): valid/clean/..., valid/noisy/..."""
    return Datasets(train=Digits(1200, 1), valid={name: Digits(300, 2 + i) for i, name in enumerate(names)})


def digits_clean_valid(context: Any = None) -> Datasets:
    """The same run with only the first of those validation sets, unnamed."""
    return Datasets(train=Digits(1200, 1), valid=Digits(300, 2))


def digits_by_split_name(context: Any = None, names: tuple[str, ...] = ("train", "validation", "test")) -> Any:
    """What a Hugging Face user returns: ``load_dataset``'s DatasetDict, its splits by name."""
    import datasets

    def table(split: Digits) -> Any:
        return datasets.Dataset.from_dict({"pixels": split.images.numpy(), "labels": split.labels.numpy()})

    return datasets.DatasetDict({name: table(Digits(600 - 200 * i, 1 + i)) for i, name in enumerate(names)})


def digits_random_split(context: Any = None) -> list[torch.utils.data.Subset[Any]]:
    """What a Lightning user returns: ``random_split``'s list of subsets (train, valid)."""
    return torch.utils.data.random_split(Digits(1500, 1), [0.8, 0.2], generator=torch.Generator().manual_seed(0))
