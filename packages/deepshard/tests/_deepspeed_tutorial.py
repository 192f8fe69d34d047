"""A training script written the way DeepSpeed's CIFAR-10 tutorial writes one.

`test_deepspeed_tutorial_script.py` replaces only the ``import deepspeed`` line with
``import deepshard.engine as deepspeed`` and runs it on 2 local ranks. The data is synthetic (no
download): 3 Gaussian blobs in 16 dimensions, a class per blob. Rank 0 prints one JSON line per
epoch with the epoch's mean loss, then the engine's facts; every rank prints a checksum of its
weights, so the test can check that the ranks stayed identical.
"""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F


def add_argument():
    parser = argparse.ArgumentParser(description="Blobs")
    parser.add_argument("-e", "--epochs", default=4, type=int, help="number of total epochs")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from distributed launcher"
    )
    parser.add_argument("--save_dir", default=None, type=str, help="where to save the weights")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Blobs(torch.utils.data.Dataset):
    def __init__(self, size=256, classes=3, features=16):
        generator = torch.Generator().manual_seed(1234)
        centers = 2.0 * torch.randn(classes, features, generator=generator)
        self.labels = torch.randint(0, classes, (size,), generator=generator)
        self.inputs = centers[self.labels] + torch.randn(size, features, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index], self.labels[index]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 3)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main():
    args = add_argument()
    torch.manual_seed(0)
    net = Net()
    trainset = Blobs()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(  # noqa: RUF059
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss, batches = 0.0, 0
        for data in trainloader:
            inputs = data[0].to(model_engine.device)
            labels = data[1].to(model_engine.device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            batches += 1
        if model_engine.global_rank == 0:
            print(json.dumps({"epoch": epoch, "loss": running_loss / batches}), flush=True)
    if args.save_dir is not None:
        model_engine.save_16bit_model(args.save_dir)
    checksum = sum(p.detach().double().sum().item() for p in model_engine.module.parameters())
    facts = {
        "rank": model_engine.global_rank,
        "local_rank": model_engine.local_rank,
        "arg_local_rank": args.local_rank,
        "world_size": model_engine.world_size,
        "stage": model_engine.zero_optimization_stage(),
        "steps": model_engine.global_steps,
        "lr": model_engine.get_lr(),
        "checksum": checksum,
    }
    print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
