"""Text: conversations and chat templates (built in, or a checkpoint's own), token counts."""
