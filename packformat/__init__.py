"""The expert pack format v1.1: constants, writer and validating reader; the bundle (packformat.bundle).

The core that storaged, inference and packtools all import; it imports none of them.
"""

from packformat.constants import ALIGNMENT, ElementType, Role
from packformat.errors import (
    ObjectChecksumError,
    PackError,
    PackFormatError,
    PackIndexError,
    PackVersionError,
    PackWriterError,
)
from packformat.index import ObjectEntry, PackHeader, RoleEntry
from packformat.reader import PackReader, verify_object
from packformat.scales import ScalePairError, check_scale_pairs
from packformat.writer import PackWriter

__all__ = [
    "ALIGNMENT", "ElementType", "Role", "ObjectChecksumError", "PackError", "PackFormatError",
    "PackIndexError", "PackVersionError", "PackWriterError", "ObjectEntry", "PackHeader",
    "RoleEntry", "PackReader", "PackWriter", "verify_object", "ScalePairError", "check_scale_pairs",
]
