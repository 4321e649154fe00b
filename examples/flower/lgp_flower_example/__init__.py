"""A Flower app that trains LeNet on lightning-gp's built-in Fashion-MNIST sample with defended updates."""
