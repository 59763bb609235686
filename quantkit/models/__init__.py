"""Finding and loading the float models quantkit works on."""
