"""The synthetic models and data of the training benchmarks (train_scaling.py and the scripts that time one of its
models): a VGG-like convnet, an MLP of many small tensors and ResNet-18, each on a fixed random batch per rank."""

MODELS = ("convnet", "mlp", "resnet18")
MLP_BLOCKS = 100             # 4 tensors per block + the head's 2: 402 gradient tensors at any width


def build_model(torch, model, width):
    builders = {"convnet": build_convnet, "mlp": build_mlp, "resnet18": build_resnet18}
    return builders[model](torch, width)


def build_convnet(torch, width):
    """A small VGG-like convnet on 32x32 RGB: ~6.7 M parameters at width 64, most of them in the first linear
    layer, so the gradient (25 MB) is large enough for communication to matter against compute."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * width * 8 * 8, 6 * width), nn.ReLU(),
        nn.Linear(6 * width, 10),
    )


def build_mlp(torch, width):
    """MLP_BLOCKS blocks of Linear(width, width) + LayerNorm + ReLU and a 10-way head: ~0.31 M parameters in 402
    tensors at width 54. Little compute per tensor, so what a framework pays per tensor decides the step time;
    the LayerNorms keep 100 layers trainable."""
    nn = torch.nn
    layers = []
    for _ in range(MLP_BLOCKS):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def build_resnet18(torch, width):
    """ResNet-18 as torchvision lays it out (7x7 stem, max pool, four stages of two basic blocks, batch norm), on
    32x32 inputs with 10 classes: 11.2 M parameters in 62 tensors at width 64, 45 MB of gradients. The stem shrinks
    the image 4x, so a step computes about as long as the convnet's while its gradients are 1.7x larger."""
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, inputs, outputs, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.downsample = None
            if stride != 1 or inputs != outputs:
                self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False),
                                                nn.BatchNorm2d(outputs))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + (x if self.downsample is None else self.downsample(x)))

    layers = [nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
              nn.MaxPool2d(3, stride=2, padding=1)]
    channels = width
    for stage in range(4):
        outputs = width << stage
        for block in range(2):
            layers.append(BasicBlock(channels, outputs, 2 if stage and not block else 1))
            channels = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def synthetic_batch(torch, model, width, rank, batch):
    generator = torch.Generator().manual_seed(1234 + rank)
    shape = (batch, width) if model == "mlp" else (batch, 3, 32, 32)
    inputs = torch.randn(*shape, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    return inputs, labels
