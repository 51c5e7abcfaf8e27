"""A training script written for torch's DataLoader, run on gloader by changing one import.

It has the shape of PyTorch's own MNIST example (argparse, `train`/`test` functions, torch's
keyword names: `batch_size`, `shuffle`, `num_workers`, `pin_memory`, `drop_last`,
`persistent_workers`, `len(loader.dataset)` in the log lines) on synthetic 28x28 digits, so it
needs no download. The only gloader-specific line is the import below.

Run: python examples/mnist_torch_style.py --epochs 2
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from gloader import DataLoader  # in torch's example: from torch.utils.data import DataLoader


class SyntheticDigits(torch.utils.data.Dataset):
    """Ten fixed 28x28 stroke patterns, one per class, with noise and a random shift per sample."""

    def __init__(self, length: int, seed: int) -> None:
        self.length = length
        self.seed = seed
        patterns = torch.zeros(10, 28, 28)
        for digit in range(10):
            patterns[digit, 4 + 2 * digit:6 + 2 * digit, 4:24] = 1.0  # a bar whose height is the class
            patterns[digit, 4:24, 3 + 2 * digit] = 0.5 * (digit % 2)
        self.patterns = patterns

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % 10
        shift = int(torch.randint(-2, 3, (), generator=generator))
        image = torch.roll(self.patterns[label], shifts=shift, dims=1)
        image = image + 0.3 * torch.randn(28, 28, generator=generator)
        return ((image - 0.1307) / 0.3081).unsqueeze(0), label


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 13 * 13, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args: argparse.Namespace, model: nn.Module, device: torch.device, train_loader: DataLoader,
          optimizer: torch.optim.Optimizer, epoch: int) -> None:
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")


def test(model: nn.Module, device: torch.device, test_loader: DataLoader) -> float:
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    test_loss /= len(test_loader.dataset)
    accuracy = correct / len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} "
          f"({100.0 * accuracy:.0f}%)\n")
    return accuracy


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="torch-style MNIST training on gloader")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--train-size", type=int, default=3000)
    args = parser.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if use_cuda else "cpu")
    train_kwargs = {"batch_size": args.batch_size, "shuffle": True, "drop_last": True}
    test_kwargs = {"batch_size": args.test_batch_size}
    if use_cuda:
        cuda_kwargs = {"pin_memory": True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)
    worker_kwargs = {"num_workers": 2, "persistent_workers": True}

    dataset1 = SyntheticDigits(args.train_size, seed=0)
    dataset2 = SyntheticDigits(1000, seed=1)
    train_loader = DataLoader(dataset1, **train_kwargs, **worker_kwargs)
    test_loader = DataLoader(dataset2, **test_kwargs, **worker_kwargs)

    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        accuracy = test(model, device, test_loader)
    # No close(), as torch's DataLoader has none: gloader stops the workers when the loaders are collected
    # on return (with a ResourceWarning, which Python shows only under -X dev or -W).
    return accuracy


if __name__ == "__main__":
    main()
