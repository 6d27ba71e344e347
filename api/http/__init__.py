"""HTTP plumbing, below every router: the error shape, the documentation pages, the bounds on a request's head, body
and connections, and the dependencies every route uses."""
