"""What the API follows live in Redis: the "finished" notices, the jobs' event streams, and the Server-Sent Events
they are written out as."""
