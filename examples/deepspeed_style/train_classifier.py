"""A CIFAR-style classifier trained the way DeepSpeed's CIFAR-10 tutorial trains one.

    zerotrain run --nproc-per-node 2 examples/deepspeed_style/train_classifier.py \\
        --deepspeed --deepspeed_config examples/deepspeed_style/ds_config.json

Written for zerotrain in the shape of https://www.deepspeed.ai/tutorials/cifar-10/ (the same
network, training loop and DeepSpeed calls), not the tutorial's own code: instead of
downloading CIFAR-10 the images are synthetic and learnable, each a random 3x4x4 pattern
upscaled to 32x32 plus pixel noise, labelled by a fixed random linear map of the pattern (a
linear "teacher"). For a script whose only change from DeepSpeed is its import lines, see
tests/scripts/deepspeed_style_train.py and docs/migrating-from-deepspeed.md.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerotrain as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR-style classifier on synthetic images")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--num-samples", default=4096, type=int, help="synthetic training images")
    parser.add_argument("--log_interval", default=10, type=int, help="steps between loss lines")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from distributed launcher"
    )
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    return args


def synthetic_images(num_samples, seed):
    """(images, labels): images (N, 3, 32, 32) float32, labels (N,) int64 in 0..9."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_samples, 3, 4, 4, generator=generator)
    images = F.interpolate(patterns, scale_factor=8, mode="nearest")
    images = images + torch.randn(images.shape, generator=generator)
    # The teacher is the same for the training and the test set, whatever their seeds.
    teacher = torch.randn(10, 3 * 4 * 4, generator=torch.Generator().manual_seed(0))
    labels = (patterns.flatten(1) @ teacher.T).argmax(dim=1)
    return images, labels


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


args = add_argument()
deepspeed.init_distributed()

# Every rank builds the same data set and the same initial weights.
torch.manual_seed(0)
trainset = torch.utils.data.TensorDataset(*synthetic_images(args.num_samples, seed=1))
testset = torch.utils.data.TensorDataset(*synthetic_images(1000, seed=2))
net = Net()

parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=trainset
)

device = model_engine.local_rank if torch.cuda.is_available() else "cpu"
is_rank0 = model_engine.global_rank == 0
criterion = nn.CrossEntropyLoss()

interval_losses = []
for epoch in range(args.epochs):
    running_loss = 0.0
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(device), data[1].to(device)
        if model_engine.fp16_enabled():
            inputs = inputs.half()
        if model_engine.bfloat16_enabled():
            inputs = inputs.bfloat16()

        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)

        model_engine.backward(loss)
        model_engine.step()

        running_loss += loss.item()
        if i % args.log_interval == (args.log_interval - 1):
            interval_losses.append(running_loss / args.log_interval)
            if is_rank0:
                print(f"[{epoch + 1}, {i + 1:5d}] loss: {interval_losses[-1]:.3f}")
            running_loss = 0.0

model_engine.eval()
correct = 0
with torch.no_grad():
    for images, labels in torch.utils.data.DataLoader(testset, batch_size=100):
        images, labels = images.to(device), labels.to(device)
        if model_engine.fp16_enabled():
            images = images.half()
        if model_engine.bfloat16_enabled():
            images = images.bfloat16()
        outputs = model_engine(images)
        correct += (outputs.argmax(dim=1) == labels).sum().item()

if is_rank0:
    accuracy = 100.0 * correct / len(testset)
    print(f"Accuracy of the network on the {len(testset)} test images: {accuracy:.1f} %")
    if interval_losses:
        first, final = interval_losses[0], interval_losses[-1]
        print(f"Finished Training: first loss {first:.4f}, final loss {final:.4f}")
    else:
        print("Finished Training: fewer than --log_interval steps, no loss to report")
