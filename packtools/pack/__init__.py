"""The expert pack format v1.1: constants, writer and validating reader."""

from packtools.pack.constants import ALIGNMENT, ElementType, Role
from packtools.pack.errors import (
    ObjectChecksumError,
    PackError,
    PackFormatError,
    PackIndexError,
    PackVersionError,
    PackWriterError,
)
from packtools.pack.index import ObjectEntry, PackHeader, RoleEntry
from packtools.pack.reader import PackReader, verify_object
from packtools.pack.scales import ScalePairError, check_scale_pairs
from packtools.pack.writer import PackWriter

__all__ = [
    "ALIGNMENT", "ElementType", "Role", "ObjectChecksumError", "PackError", "PackFormatError",
    "PackIndexError", "PackVersionError", "PackWriterError", "ObjectEntry", "PackHeader",
    "RoleEntry", "PackReader", "PackWriter", "verify_object", "ScalePairError", "check_scale_pairs",
]
