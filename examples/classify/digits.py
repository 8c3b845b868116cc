"""A small image classifier, the way you would bring your own: a Dataset, a model returning logits.

The data are synthetic 8x8 "digits" (a noisy prototype per class), made here so the example
runs anywhere without a download; swap in torchvision's MNIST or your own folder of images and
nothing else changes. coretrain finds these functions by import path (see classify.toml).
"""

from __future__ import annotations

import torch

from coretrain import Datasets

CLASSES = 10


class Digits(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        prototypes = torch.randn(CLASSES, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (count,), generator=g)
        self.images = prototypes[self.labels] + 2.5 * torch.randn(count, 1, 8, 8, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]  # (input, target): model.loss uses the last


def build_data(train: int = 6000, valid: int = 1000, test: int = 1000) -> Datasets:
    return Datasets(train=Digits(train, 1), valid=Digits(valid, 2), test=Digits(test, 3))


class SmallCNN(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(width, 2 * width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
        )
        self.head = torch.nn.Linear(2 * width * 16, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))  # logits; the loss is configured


def build_model(width: int = 16) -> torch.nn.Module:
    return SmallCNN(width)
