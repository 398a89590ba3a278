"""Graph techniques: rewrites that keep the math (folding, layouts, padding removal)."""
