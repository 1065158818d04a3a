"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

The base layers are trained with FedAvg; the last `local_layers` layers (the
personalization layers, by default the classifier head) stay on the client:
never averaged, never sent. A layer is one top-level module of the model with
its normalization layer (`pfljax.core.layers`); the BatchNorm statistics of a
personal layer stay local with it. The option was called `personal_layers`
before; that name is refused with a message naming `local_layers`.

The paper evaluates with 1 to 4 personalization layers (ResNet / MobileNet); 1
is the default here. Each client's personal layers start from the same initial
values and change only when the client trains. LG-FedAvg is the same mechanism
with the first layers local.
"""

from __future__ import annotations

from pfljax.algorithms import fedavg

RENAMED_OPTIONS = {"personal_layers": "local_layers"}
build = fedavg.layers_local_builder("fedper", "last", RENAMED_OPTIONS)
