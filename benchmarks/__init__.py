"""The lab: measurement scripts and their dated reports (README.md), apart from the product."""
