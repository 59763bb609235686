"""`python -m quantkit ...` is the `quantkit` command; torchrun starts it this way (`torchrun ... -m quantkit`)."""
from .cli import main

if __name__ == "__main__":
    main()
