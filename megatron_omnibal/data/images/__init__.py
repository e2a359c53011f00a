"""Images: sizes from headers, the tiling rules, decoding into normalised tiles."""
