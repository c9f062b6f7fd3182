//! File transfers (being written).
