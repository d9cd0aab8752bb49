"""Elastic data-parallel training with FastHorovod: a copy-and-adapt example (docs/elastic.md).

A CIFAR-style CNN (about 2.5 M parameters) on a synthetic CIFAR-sized dataset (no download), Horovod's elastic API unchanged:
``hvd.elastic.run``, ``TorchState`` and ``ElasticSampler``. Workers may come and go (spot
instances): on every change the job restores or keeps the last commit, forms Horovod and the
proxies again for the new world, and goes on; no checkpoint file is involved.

    horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        python examples/elastic_train.py --epochs 2

(``fasthorovodrun`` takes the same flags; on an emulated cloud see docs/elastic.md.)
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import fasthorovod.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic dataset")
    parser.add_argument("--lr", type=float, default=0.0125, help="per worker; scaled by the number of workers")
    parser.add_argument("--commit-every", type=int, default=10, help="batches between commits")
    parser.add_argument("--algorithm", default="ssgd", help="ssgd, od-sgd, ssd-sgd, cd-sgd, ... (docs/algorithms.md)")
    return parser.parse_args()


def cifar_cnn(num_classes: int = 10) -> nn.Module:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                             nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                             nn.MaxPool2d(2))
    return nn.Sequential(block(3, 64), block(64, 128), block(128, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(256, num_classes))


def synthetic_cifar(samples: int):
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(42)
    dataset = synthetic_cifar(args.samples)
    model = cifar_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         algorithm=args.algorithm)

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset():
        # the world changed: keep the per-worker learning rate, report the new size
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} workers now, resuming at epoch {state.epoch} batch {state.batch}", flush=True)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            started, images = time.time(), 0
            for state.batch, (x, y) in enumerate(loader, start=state.batch):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(state.batch, args.batch_size)
                images += x.shape[0] * hvd.size()
                if state.batch % args.commit_every == 0:
                    state.commit()  # host changes are noticed here (HostsUpdatedInterrupt)
                    if hvd.rank() == 0:
                        print(f"epoch {state.epoch} batch {state.batch} loss {loss.item():.3f} "
                              f"{images / (time.time() - started):.1f} images/s on {hvd.size()} workers", flush=True)
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if hasattr(optimizer, "sync_weights"):  # delayed policies: parameters <- global weights
        optimizer.sync_weights()
    if hvd.rank() == 0:
        print("done", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
