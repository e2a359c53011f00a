"""The event-driven pipeline simulator (1F1B, interleaved) and its Gantt chart. Pure numpy."""
