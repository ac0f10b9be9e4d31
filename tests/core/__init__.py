"""The phases of a step: how the loop marks them and who reads them."""
