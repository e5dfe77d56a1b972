"""`python -m pagedserve ...` is the `pagedserve` command."""

from pagedserve.services.cli import main

if __name__ == "__main__":
    main()
