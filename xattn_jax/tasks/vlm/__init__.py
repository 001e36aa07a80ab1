"""The vision-language tasks."""
