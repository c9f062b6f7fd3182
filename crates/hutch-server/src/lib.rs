//! The HTTP layer (being written).
