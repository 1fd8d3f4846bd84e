"""Quantized drop-in replacements for torch.nn layers (one file per layer family)."""
from ._base import QModule

__all__ = ["QModule"]
# One import block per layer file; the converter finds every QModule subclass listed here.
from .activation import (QELU, QGELU, QHardsigmoid, QHardswish, QHardtanh, QLeakyReLU, QMish,
                         QReLU, QReLU6, QSigmoid, QSiLU, QSoftplus, QTanh)
from .dropout import QDropout, QDropout1d, QDropout2d, QDropout3d
from .pool import (QAdaptiveAvgPool1d, QAdaptiveAvgPool2d, QAdaptiveAvgPool3d, QAdaptiveMaxPool1d,
                   QAdaptiveMaxPool2d, QAdaptiveMaxPool3d, QAvgPool1d, QAvgPool2d, QAvgPool3d,
                   QMaxPool1d, QMaxPool2d, QMaxPool3d)
from .softmax import QSoftmax
from .upsample import QUpsample

__all__ += ["QReLU", "QReLU6", "QLeakyReLU", "QHardtanh", "QGELU", "QSiLU", "QSigmoid", "QTanh",
            "QELU", "QSoftplus", "QHardswish", "QHardsigmoid", "QMish", "QDropout", "QDropout1d", "QDropout2d", "QDropout3d",
            "QMaxPool1d", "QMaxPool2d", "QMaxPool3d", "QAvgPool1d", "QAvgPool2d", "QAvgPool3d",
            "QAdaptiveAvgPool1d", "QAdaptiveAvgPool2d", "QAdaptiveAvgPool3d",
            "QAdaptiveMaxPool1d", "QAdaptiveMaxPool2d", "QAdaptiveMaxPool3d", "QUpsample",
            "QSoftmax"]
from .conv import (QConv1d, QConv2d, QConv3d, QConvTranspose1d, QConvTranspose2d,
                   QConvTranspose3d)
from .linear import QLinear
from .norm import QBatchNorm1d, QBatchNorm2d, QBatchNorm3d, QGroupNorm, QLayerNorm, QSyncBatchNorm

__all__ += ["QConv1d", "QConv2d", "QConv3d", "QConvTranspose1d", "QConvTranspose2d",
            "QConvTranspose3d", "QLinear", "QBatchNorm1d", "QBatchNorm2d", "QBatchNorm3d",
            "QSyncBatchNorm", "QLayerNorm", "QGroupNorm"]
from .rmsnorm import QRMSNorm

__all__ += ["QRMSNorm"]
# Q classes for other libraries' classes, mapped by dotted class path (third_party.THIRD_PARTY);
# they have no _FLOAT_MODULE, so the torch-class mapping does not list them.
from .third_party import QBatchNormAct2d, QHFConv1D, QLayerNorm2d

__all__ += ["QHFConv1D", "QLayerNorm2d", "QBatchNormAct2d"]
