"""Video: headers, exact-frame decoding, frames as tiles."""
