"""OPT: pre-LN decoder, ReLU MLP. Its hidden dropout is functional (``F.dropout``), so those masks
stay float tensors (only ``nn.Dropout`` modules are stored as bits)."""
from .common import encoder_patcher

apply_division_to_opt = encoder_patcher()
