"""Digits: latent readers (Perceiver, Q-Former) and the ViT they read, on scikit-learn's digits."""
